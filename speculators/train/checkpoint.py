"""Training checkpoints: atomic writes, keep-last-N, `latest` / `best` pointer files, and exact resume.

A checkpoint is `checkpoints/step-XXXXXXX/` holding
- `config.json` + `model.safetensors` (`speculators.models.io.save_speculator`: the family's vLLM-layout config with a
  `speculators_native` block recording the recipe, package versions, step and the target fingerprint),
- `pairing.json` (`speculators.core.pairing`: the target's name, revision and content/tokenizer hashes the
  runtime checks),
- `training_state/`: `accelerator.save_state` (trainable weights, optimizer, RNG of every rank; DeepSpeed/FSDP
  shards in their own layout) + `trainer_state.json` (optimizer step, micro-step = data position, tokens seen,
  world size, best-so-far, validation history). The LR schedule is a pure function of the optimizer step.
Everything is written into `checkpoints/.tmp-step-XXXXXXX/` and renamed into place (`core.atomic.replace_dir`), so
a crash mid-write never leaves a step dir that looks complete; pointers are tiny text files replaced atomically.
`best` names the checkpoint with the highest held-out simulated tau (never the lowest loss).

What it does not do: decide when to save or evaluate (loop.py), or export for serving (speculators.export).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from accelerate.utils import DistributedType
from safetensors import safe_open

from speculators.core import atomic
from speculators.core.atomic import write_text_atomic
from speculators.core.checkpoints import (
    STATE_DIR,
    STEP_RE,
    TRAINER_STATE,
    is_resumable,
    list_checkpoints,
    read_pointer,
    step_name,
    write_pointer,
)
from speculators.core.errors import SpeculatorsError
from speculators.core.pairing import pairing_record, read_pairing, write_pairing
from speculators.models import family_of
from speculators.models.io import read_speculator_config, save_speculator

POINTER_TMP_RE = re.compile(r"^\..+\.tmp\d+$")  # `write_text_atomic`'s temp of a file such as `best`
SUMMARY_FILE = "train-summary.json"


def remove_checkpoint_dir(path: Path) -> None:
    """Rename out of the way first (to `.trash-<name>-<pid>`, which `clean_partial` removes), then delete: a
    half-deleted dir never keeps a valid-looking name."""
    path = Path(path)
    atomic.remove_dir(path, trash=path.with_name(f".trash-{path.name}-{os.getpid()}"))


def clean_partial(root: Path) -> None:
    """Remove temp / trash dirs and half-written pointer files (`write_text_atomic` temps) left by a crash."""
    root = Path(root)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-step-", ".trash-")):
                shutil.rmtree(p, ignore_errors=True)
            elif p.is_file() and POINTER_TMP_RE.match(p.name):
                p.unlink(missing_ok=True)


def _pointed(root: Path, name: str) -> Path | None:
    """`read_pointer` for training's own bookkeeping: a broken pointer counts as none (training rewrites it)."""
    with contextlib.suppress(SpeculatorsError):
        return read_pointer(root, name)
    return None


def prune(root: Path, keep_last: int) -> list[Path]:
    """Keep the newest `keep_last` checkpoints plus whatever `latest` / `best` name; return the removed dirs."""
    ckpts = list_checkpoints(root)
    protect = {p.name for p in (_pointed(root, "latest"), _pointed(root, "best")) if p is not None}
    keep = {p.name for p in ckpts[-max(1, keep_last):]} | protect
    removed = []
    for p in ckpts:
        if p.name not in keep:
            remove_checkpoint_dir(p)
            removed.append(p)
    return removed


def read_trainer_state(ckpt: Path) -> dict:
    path = Path(ckpt) / STATE_DIR / TRAINER_STATE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpeculatorsError(f"checkpoint {ckpt} has no readable {STATE_DIR}/{TRAINER_STATE} ({exc}); "
                               "it cannot be resumed (train.resume=never starts over)") from None


# ----------------------------------------------------------------------------------------------------------------
# resume


def find_resume(resume: str, root: Path) -> Path | None:
    """The checkpoint to resume from: "never" -> None; "auto" -> `latest` (or the newest complete step dir) under
    `root`, None when there is none; anything else is a checkpoint path that must exist."""
    if resume == "never":
        return None
    if resume == "auto":
        latest = _pointed(root, "latest")  # a broken pointer: fall back to the newest resumable step dir
        if latest is not None and is_resumable(latest):
            return latest
        resumable = [p for p in list_checkpoints(root) if is_resumable(p)]
        return resumable[-1] if resumable else None
    path = Path(resume)
    if path.is_dir() and STEP_RE.match(path.name) is None and (path / "latest").is_file():
        pointed = read_pointer(path, "latest")  # a checkpoints/ dir: take its latest
        if pointed is not None:
            path = pointed
    if not path.is_dir():
        raise SpeculatorsError(f"train.resume: checkpoint {resume} not found (give a checkpoints/step-XXXXXXX dir, "
                               "'auto' or 'never')")
    if not is_resumable(path):
        raise SpeculatorsError(f"train.resume: {resume} is not a complete training checkpoint (needs config.json, "
                               f"model.safetensors, pairing.json and {STATE_DIR}/{TRAINER_STATE})")
    return path


def check_resume(ckpt: Path, family: str, target_fp: dict, trainable_shapes: dict[str, tuple[int, ...]]) -> dict:
    """Refuse a checkpoint of another family, another target or another architecture. Returns trainer state."""
    theirs = family_of(read_speculator_config(ckpt))
    if theirs != family:
        raise SpeculatorsError(f"cannot resume from {ckpt}: it is a {theirs} checkpoint but the recipe trains "
                               f"{family} (point train.resume at a {family} checkpoint, or use train.resume=never)")
    want = read_pairing(ckpt)["target"]
    if want["content_hash"] != target_fp["content_hash"] or want["tokenizer_hash"] != target_fp["tokenizer_hash"]:
        raise SpeculatorsError(f"cannot resume from {ckpt}: it was trained for {want['name_or_path']}@"
                               f"{want['revision']} but the recipe's target is {target_fp['name_or_path']}@"
                               f"{target_fp['revision']}")
    with safe_open(str(Path(ckpt) / "model.safetensors"), framework="pt") as fh:
        saved = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118
    for name, shape in trainable_shapes.items():
        if name in saved and saved[name] != shape:
            raise SpeculatorsError(f"cannot resume from {ckpt}: {name} has shape {list(saved[name])} there but "
                                   f"{list(shape)} in this recipe's speculator (the speculator section changed; "
                                   "use train.resume=never)")
    return read_trainer_state(ckpt)


# ----------------------------------------------------------------------------------------------------------------
# save


class CheckpointWriter:
    """Writes checkpoints for one run; every rank calls `save` (collectives inside), rank 0 writes the files."""

    def __init__(self, root: Path, accelerator: Any, keep_last: int) -> None:
        self.root = Path(root)
        self.acc = accelerator
        self.keep_last = keep_last
        self._frozen_hook = None

    def _state_kwargs(self) -> dict:
        if self.acc.distributed_type == DistributedType.DEEPSPEED:
            return {"exclude_frozen_parameters": True}
        return {}

    def install_hooks(self, model: Any) -> None:
        """Keep frozen target copies (embeddings ...) out of training_state/: they come from the target."""
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}

        def drop_frozen(models: list, weights: list, output_dir: str) -> None:
            for w in weights:
                for name in [k for k in w if k in frozen]:
                    del w[name]

        self._frozen_hook = self.acc.register_save_state_pre_hook(drop_frozen)

    def load_state(self, ckpt: Path) -> None:
        kwargs = {"load_module_strict": False} if self.acc.distributed_type == DistributedType.DEEPSPEED else \
            {"strict": False}
        self.acc.load_state(str(Path(ckpt) / STATE_DIR), **kwargs)

    def save(self, step: int, spec_for_save: Any, *, metadata: dict, target_fp: dict, layer_ids: list[int] | None,
             recipe: dict, trainer_state: dict, evaluation: dict | None, is_best: bool) -> Path:
        """Write step-XXXXXXX atomically, move `latest` (and `best` when `is_best`), prune old ones."""
        acc = self.acc
        name = step_name(step)
        tmp = self.root / f".tmp-{name}"
        final = self.root / name
        if acc.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp / STATE_DIR), **self._state_kwargs())
        spec = spec_for_save()  # collective under ZeRO-3 (gathers the weights); a plain module otherwise
        if acc.is_main_process:
            save_speculator(spec, tmp, metadata)
            record = pairing_record(target=target_fp, family=metadata["family"], layer_ids=layer_ids, draft_dir=tmp,
                                    recipe=recipe, evaluation=evaluation, extra={"training": {"step": step}})
            write_pairing(tmp, record)
            write_text_atomic(tmp / STATE_DIR / TRAINER_STATE, json.dumps(trainer_state, indent=2) + "\n")
            remove_checkpoint_dir(final)
            atomic.replace_dir(tmp, final)  # `final` is gone by now: a plain rename
            write_pointer(self.root, "latest", final)
            if is_best:
                write_pointer(self.root, "best", final)
            prune(self.root, self.keep_last)
        acc.wait_for_everyone()
        return final
