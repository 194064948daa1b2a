"""Vocabulary that several stages share, below every stage and above nothing but config / errors / metrics:

- `trees`: draft-tree shapes (TreeSpec, TreeConfig) the models draft and the runtime verifies;
- `sampling`: the sampling law (SamplingParams, logits_to_probs) every stage applies the same way;
- `workloads`: the held-out workload rows (data/workloads/*.jsonl) that evaluate, bench and export read;
- `pairing`: the (draft revision, target revision) record that export writes and everything else checks;
- `atomic`: the one atomic writer (temp file + fsync + os.replace, and whole directories);
- `checkpoints`: the checkpoint-folder format (step dirs, `latest` / `best` pointers) training writes and others read;
- `workers`: re-running a stage as several processes under `accelerate launch` (capture, training).

Nothing here imports a stage (data, train, evaluate, export, serving) or `models`.
"""
