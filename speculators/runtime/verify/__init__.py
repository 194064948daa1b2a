"""Lossless verification of a draft tree (`lossless`), its batched inputs (`inputs`) and the exact expected
acceptance used as a control (`expect`). Not here: drafting or the target forward."""
