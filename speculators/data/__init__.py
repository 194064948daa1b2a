"""Data stages: prepare (chat template + loss masks), regenerate, capture (hidden-state shards), draft vocab,
and the held-out workload schema. Submodules import their heavy dependencies lazily."""
