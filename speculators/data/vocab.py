"""Draft vocabulary for EAGLE-3: token frequencies over loss-masked tokens -> `d2t` / `t2d`.

- `token_frequencies(input_ids, loss_mask, vocab_size)`: counts of assistant tokens (what the draft must predict).
- `forced_draft_ids(special_ids, eos_ids, data_manifest, vocab_size)`: the ids every draft vocabulary keeps
  (capture's and online training's alike).
- `build_vocab(token_freq, draft_vocab_size, always_include_ids)`: the `always_include_ids` (EOS, chat markers,
  every special token) plus the most frequent tokens (ties broken by the lower id), padded with the lowest unused
  ids when too few tokens occur, sorted ascending. `d2t[i] = target_id(i) - i` (int64 offsets, vLLM layout:
  target_id = draft_id + d2t[draft_id]); `t2d` [V] bool marks the target ids in the draft vocab.
- `token_freq.safetensors` (`token_freq` [V] int64 + the always-include ids) and `vocab-<Vd>.safetensors`
  (`d2t`, `t2d`) live in the features dir; `load_vocab(features_dir, Vd)` reads the file for that size, or builds
  and caches it from `token_freq.safetensors` (the file name carries the size, so a stale mapping of another size
  is never reused).
- `coverage(t2d, counts)`: the share of token occurrences whose id is in the draft vocab.

This module does not run models or read datasets.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from speculators.core.atomic import atomic_path
from speculators.core.errors import SpeculatorsError

TOKEN_FREQ_FILE = "token_freq.safetensors"


def vocab_file(features_dir: str | Path, draft_vocab_size: int) -> Path:
    return Path(features_dir) / f"vocab-{int(draft_vocab_size)}.safetensors"


def token_frequencies(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[T] ids, [T] mask -> [V] int64 counts of the loss-masked ids."""
    ids = input_ids[loss_mask.bool()].long()
    if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
        raise SpeculatorsError(f"token id {int(ids.max())} is outside the target vocab ({vocab_size}); the data was "
                               "tokenized for another tokenizer — re-run prepare")
    return torch.bincount(ids, minlength=vocab_size).long()


def forced_draft_ids(special_ids: Iterable[int | None], eos_ids: Iterable[int], data_manifest: dict,
                     vocab_size: int) -> list[int]:
    """The ids every draft vocabulary keeps whatever their counts (`build_vocab`'s `always_include_ids`): the
    tokenizer's special tokens (`all_special_ids`), the EOS ids the caller takes the target's end from, and the
    end-of-turn ids the prepared data's manifest records; those inside the target vocab, ascending."""
    ids = {int(i) for i in special_ids if i is not None}
    ids |= {int(i) for i in eos_ids}
    ids.update(int(i) for i in data_manifest.get("tokenizer", {}).get("end_of_turn_ids", []))
    return sorted(i for i in ids if 0 <= i < vocab_size)


def build_vocab(token_freq: torch.Tensor, draft_vocab_size: int,
                always_include_ids: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (d2t [Vd] int64 offsets, t2d [V] bool)."""
    freq = token_freq.long()
    v = int(freq.shape[0])
    vd = int(draft_vocab_size)
    if not 0 < vd <= v:
        raise SpeculatorsError(f"draft_vocab_size={vd} must be in [1, {v}] (the target vocab size)")
    forced = sorted({int(i) for i in (always_include_ids or []) if 0 <= int(i) < v})
    if len(forced) > vd:
        raise SpeculatorsError(f"draft_vocab_size={vd} is smaller than the {len(forced)} special tokens that must be "
                               "in the draft vocabulary; raise speculator.draft_vocab_size")
    chosen = torch.zeros(v, dtype=torch.bool)
    chosen[forced] = True
    # most frequent first, ties by lower id: stable sort of -freq over ids in ascending order
    order = torch.sort(-freq, stable=True).indices
    need = vd - len(forced)
    for tid in order.tolist():
        if need == 0:
            break
        if not chosen[tid] and freq[tid] > 0:
            chosen[tid] = True
            need -= 1
    if need:  # pad with the lowest unused ids
        for tid in range(v):
            if need == 0:
                break
            if not chosen[tid]:
                chosen[tid] = True
                need -= 1
    selected = torch.nonzero(chosen).flatten().long()  # ascending
    d2t = selected - torch.arange(vd, dtype=torch.long)
    return d2t, chosen


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    return torch.arange(d2t.shape[0], dtype=torch.long) + d2t


def coverage(t2d: torch.Tensor, counts: torch.Tensor) -> float:
    """Share of token occurrences (counts [V]) whose id is in the draft vocab."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, meta: dict) -> None:
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"speculators": json.dumps(meta, sort_keys=True)})


def save_token_freq(features_dir: str | Path, token_freq: torch.Tensor, always_include_ids: list[int],
                    meta: dict | None = None) -> Path:
    path = Path(features_dir) / TOKEN_FREQ_FILE
    _atomic_save({"token_freq": token_freq.long().contiguous(),
                  "always_include_ids": torch.tensor(sorted(set(always_include_ids)), dtype=torch.long)},
                 path, meta or {})
    return path


def load_token_freq(features_dir: str | Path) -> tuple[torch.Tensor, list[int]]:
    path = Path(features_dir) / TOKEN_FREQ_FILE
    if not path.is_file():
        raise SpeculatorsError(f"{path} not found; run `speculators capture` (it writes the token frequencies)")
    try:
        t = load_file(str(path))
    except Exception as exc:  # noqa: BLE001
        raise SpeculatorsError(f"{path} is unreadable ({exc}); re-run capture") from None
    return t["token_freq"], t["always_include_ids"].tolist()


def save_vocab(features_dir: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, meta: dict | None = None) -> Path:
    path = vocab_file(features_dir, d2t.shape[0])
    _atomic_save({"d2t": d2t.long().contiguous(), "t2d": t2d.bool().contiguous()}, path, meta or {})
    return path


def _check_vocab(d2t: torch.Tensor, t2d: torch.Tensor, vd: int, path: Path) -> None:
    if d2t.dtype != torch.long or t2d.dtype != torch.bool or d2t.shape != (vd,) or int(t2d.sum()) != vd:
        raise SpeculatorsError(f"{path} is not a valid draft vocabulary of size {vd}; delete it and re-run capture")
    if not torch.equal(torch.nonzero(t2d).flatten(), draft_to_target_ids(d2t)):
        raise SpeculatorsError(f"{path}: d2t and t2d disagree; delete it and re-run capture")


def load_vocab(features_dir: str | Path, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64, t2d [V] bool) for this draft vocab size; built from token_freq and cached if missing."""
    path = vocab_file(features_dir, draft_vocab_size)
    if path.is_file():
        try:
            t = load_file(str(path))
        except Exception as exc:  # noqa: BLE001
            raise SpeculatorsError(f"{path} is unreadable ({exc}); delete it and re-run capture") from None
        d2t, t2d = t.get("d2t"), t.get("t2d")
        if d2t is None or t2d is None:
            raise SpeculatorsError(f"{path} lacks d2t/t2d; delete it and re-run capture")
        _check_vocab(d2t, t2d, int(draft_vocab_size), path)
        return d2t, t2d
    freq, forced = load_token_freq(features_dir)
    d2t, t2d = build_vocab(freq, draft_vocab_size, forced)
    save_vocab(features_dir, d2t, t2d, {"draft_vocab_size": int(draft_vocab_size)})
    return d2t, t2d
