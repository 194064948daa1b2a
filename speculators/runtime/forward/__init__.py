"""The target's forward inside the runtime: runners (HF modules or the fused path), the static KV cache, rows of a
batch, memory sizing and the check that a target is supported. Not here: drafting, verification, scheduling."""
