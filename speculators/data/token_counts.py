"""Token counts that choose EAGLE-3's draft vocabulary, made when capture finishes (rank 0).

- `split_counts`: assistant-token counts [V] of the training split and of the held-out split (vectorised over
  Arrow, one pass over the prepared data).
- `workload_counts`: token counts [V] of the held-out workload prompts, per cohort, as the target sees them.
- `always_included_ids`: special tokens, EOS and end-of-turn ids, which every draft vocabulary keeps.

Nothing here writes files (capture.py writes `token_freq.safetensors`; vocab.py builds the vocabulary).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch

from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.target import eos_token_ids, load_tokenizer
from speculators.core.workloads import load_workloads
from speculators.data import shards
from speculators.data.chat import ChatEncoder
from speculators.data.vocab import forced_draft_ids


def always_included_ids(recipe: Recipe, data_manifest: dict, vocab_size: int) -> list[int]:
    """Special tokens, EOS (the tokenizer's) and the prepared data's end-of-turn ids: `vocab.forced_draft_ids` of the
    recipe's tokenizer (every draft vocabulary keeps them)."""
    tok = load_tokenizer(recipe.target)
    return forced_draft_ids(tok.all_special_ids, eos_token_ids(tok), data_manifest, vocab_size)


def split_counts(ds: Any, vocab_size: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assistant-token counts [V] of the train split and of the held-out val split of the prepared dataset `ds`
    (vectorised over Arrow)."""
    n = len(ds)
    row_ids = [str(i) for i in ds["id"]] if "id" in ds.column_names else None
    is_val = np.zeros(n, dtype=bool)
    is_val[shards.split_side_indices(n, "val", val_fraction, seed, row_ids)] = True
    counts = {False: np.zeros(vocab_size, dtype=np.int64), True: np.zeros(vocab_size, dtype=np.int64)}
    ids_col, mask_col = ds.data.column("input_ids"), ds.data.column("loss_mask")
    base = 0
    for ids_chunk, mask_chunk in zip(ids_col.chunks, _rechunk(mask_col, ids_col), strict=True):
        lens = np.diff(ids_chunk.offsets.to_numpy())
        start, stop = int(ids_chunk.offsets[0].as_py()), int(ids_chunk.offsets[-1].as_py())
        ids = ids_chunk.values.to_numpy()[start:stop].astype(np.int64)
        m0, m1 = int(mask_chunk.offsets[0].as_py()), int(mask_chunk.offsets[-1].as_py())
        mask = mask_chunk.values.to_numpy()[m0:m1] > 0
        row_val = np.repeat(is_val[base:base + len(lens)], lens)
        if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
            raise SpeculatorsError(f"token id {int(ids.max())} is outside the target vocab ({vocab_size}); the "
                                   "data was tokenized for another tokenizer — re-run prepare")
        for flag in (False, True):
            sel = mask & (row_val == flag)
            counts[flag] += np.bincount(ids[sel], minlength=vocab_size)
        base += len(lens)
    return torch.from_numpy(counts[False]), torch.from_numpy(counts[True])


def _rechunk(col: Any, like: Any) -> list[Any]:
    """`col` cut into chunks with the same row counts as `like` (both are columns of one table)."""
    out, at = [], 0
    whole = pa.concat_arrays(col.chunks) if col.num_chunks != 1 else col.chunk(0)
    for chunk in like.chunks:
        out.append(whole.slice(at, len(chunk)))
        at += len(chunk)
    return out


def workload_counts(recipe: Recipe, vocab_size: int) -> dict[str, torch.Tensor]:
    """Token counts [V] of the held-out workload prompts, per cohort (as the target would see them)."""
    rows = load_workloads(recipe.evaluate.workloads, recipe.evaluate.max_rows_per_cohort)
    tok = load_tokenizer(recipe.target)
    enc = ChatEncoder(tok, recipe.data.chat_template_kwargs)
    out: dict[str, torch.Tensor] = {}
    for row in rows:
        ids = enc.prompt_ids(row.messages, None) if row.messages else tok(row.prompt)["input_ids"]
        c = torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
        out[row.cohort] = out.get(row.cohort, torch.zeros(vocab_size, dtype=torch.long)) + c
    return out
