"""What every room shares, below every stage, app, the runtime and the models:

- `config` (every recipe key as a dataclass), `recipes` (YAML <-> Recipe), `options` (each command's flags);
- `target`: loading a target (HF folder, package, GGUF), its taps and fingerprints; `target_sources` fetches one;
- `metrics`: the one implementation of the acceptance formulas; `errors`, `logs`;
- `trees`: draft-tree shapes (TreeSpec, TreeConfig) the models draft and the runtime verifies;
- `sampling`: the sampling law (SamplingParams, logits_to_probs) every stage applies the same way;
- `workloads`: the held-out workload rows (data/workloads/*.jsonl) that evaluate, bench and export read;
- `pairing`: the (draft revision, target revision) record that export writes and everything else checks;
- `atomic`: the one atomic writer (temp file + fsync + os.replace, and whole directories);
- `checkpoints`: the checkpoint-folder format (step dirs, `latest` / `best` pointers) training writes and others read;
- `workers`: re-running a stage as several processes under `accelerate launch` (capture, training);
- `tracking`, `hashing`, `vllm_env`: run tracking, content hashes, finding the vLLM environment.

Nothing here imports a stage (data, train, evaluate, export, serving, oracle, house), the runtime or `models`; the
package root keeps only cli.py and pipeline.py, which sit above everything.
"""
