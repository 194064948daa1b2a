"""What drafts in the runtime: a trained speculator directory loaded and checked against its target (`load`),
prompt-lookup n-gram drafting (`ngram`, `model_free`) and grafting n-gram nodes onto a speculator's tree (`graft`).
Not here: the draft networks themselves (models/), verification."""
