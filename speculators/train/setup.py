"""What training starts from, validated before anything is written: the target (frozen weights, fingerprint, EOS
ids), the data source and its split, the draft vocabulary, and the training signature (what a checkpoint depends
on, so a resume or a skipped stage never mixes two trainings).

- `preflight(recipe)`: the cheap checks (no weights loaded); the launcher runs them before starting workers.
- `load_setup(recipe, device)` -> `Setup`: everything the loop needs, nothing written.
- `checked_draft_vocab(recipe, vocab_size, eos_ids, build)`: the draft vocabulary checks both run (the stored
  vocabulary, or online the one built from the training split, covers every EOS id).
- `train_signature(recipe)`: the hash a checkpoint and `train-summary.json` record.

Not here: the optimisation loop (loop.py), the accelerator (accelerator.py), checkpoints (checkpoint.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.pairing import read_pairing
from speculators.core.recipes import to_dict
from speculators.core.target import (
    eos_token_ids,
    final_norm,
    fingerprint_target,
    input_embeddings,
    is_local,
    load_target,
    load_tokenizer,
    output_head,
    text_config,
)
from speculators.data import vocab as vocab_mod
from speculators.data.artifacts import read_manifest
from speculators.data.shards import FeatureStore
from speculators.models import SPECULATORS, check_family, family_of
from speculators.models.base import TargetWeights
from speculators.models.io import read_speculator_config, target_weights
from speculators.train import checkpoint as ck
from speculators.train.batches import FeatureSource, PreparedSource, train_val_indices
from speculators.train.optimizer import check_optimizer_options

_NOT_IN_SIGNATURE = {"resume", "trackers", "wandb_project", "wandb_entity", "wandb_group", "wandb_tags", "log_every",
                     "num_workers", "eval_every", "keep_last", "accelerate_config", "num_processes", "save_every",
                     "curve_points", "curve_rows", "curve_share"}


SHARDS_VERIFIED_ENV = "SPECULATORS_SHARDS_VERIFIED"  # a launcher's preflight verified every feature shard's checksum

# ----------------------------------------------------------------------------------------------------------------
# what a trained checkpoint depends on


# recipe options added after checkpoints already existed, with the default that reproduces the earlier training
_NEW_OPTIONS = {"loss": "kl", "teacher_temperature": 1.0, "teacher_rest_mass": False, "fc_norm": False,
                "norm_before_fc": False, "norm_output": False, "freeze_lm_head": False, "norm_from_target": False}


def train_signature(recipe: Recipe) -> str:
    """Hash of everything that changes what training produces (not where/how it is launched or logged)."""
    def without_new_defaults(section: dict) -> dict:  # options added later leave older signatures unchanged
        return {k: v for k, v in section.items() if k not in _NEW_OPTIONS or v != _NEW_OPTIONS[k]}

    data = {"seed": recipe.seed, "target": to_dict(recipe.target),
            "speculator": without_new_defaults(to_dict(recipe.speculator)),
            "capture": {"mode": recipe.capture.mode, "layer_ids": recipe.capture.layer_ids},
            "val_fraction": recipe.data.val_fraction,
            "train": without_new_defaults({k: v for k, v in to_dict(recipe.train).items()
                                           if k not in _NOT_IN_SIGNATURE})}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------------
# setup: target, features, speculator


@dataclass
class Setup:
    model_config: Any
    weights: Any  # TargetWeights
    fingerprint: dict
    tokenizer: Any
    layer_ids: list[int] | None
    d2t: Any  # [Vd] long or None
    source: Any  # SequenceSource
    train_idx: list[int]
    val_idx: list[int]
    target_model: Any | None  # online mode only
    mode: str
    store: Any | None = None


def check_eos_covered(d2t: Any, eos_ids: list[int], where: str) -> None:
    covered = set((torch.arange(d2t.shape[0]) + d2t.cpu()).tolist())
    missing = [e for e in eos_ids if e not in covered]
    if missing:
        raise SpeculatorsError(f"the draft vocabulary ({where}) does not cover the target's EOS token id(s) "
                               f"{missing}: the speculator could never propose the end of a turn; rebuild it with "
                               "EOS included (re-run capture) or raise speculator.draft_vocab_size")


def stored_vocab_dir(recipe: Recipe) -> Path | None:
    """Where training reads its reduced draft vocabulary (or the token counts that build it): the features dir when
    training offline, or online when capture wrote either file there; None when online training builds its own."""
    features, vd = recipe.paths.features, recipe.speculator.draft_vocab_size
    if recipe.capture.mode == "offline" or (vd is not None and (
            vocab_mod.vocab_file(features, vd).is_file() or (features / vocab_mod.TOKEN_FREQ_FILE).is_file())):
        return features
    return None


def checked_draft_vocab(recipe: Recipe, vocab_size: int, eos_ids: list[int],
                        build: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
    """The reduced draft vocabulary training uses (d2t [Vd] long), checked to cover every EOS id in `eos_ids`: the
    stored one (`stored_vocab_dir`), else `build()` (online: from the training split). None for a speculator on the
    target's whole vocabulary, or with no stored vocabulary and no `build` (preflight: nothing to check yet)."""
    vd = recipe.speculator.draft_vocab_size
    if vd is None or vd == vocab_size:
        return None
    directory = stored_vocab_dir(recipe)
    if directory is not None:
        d2t, _ = vocab_mod.load_vocab(directory, vd)
    elif build is not None:
        d2t = build()
    else:
        return None
    check_eos_covered(d2t, eos_ids, f"{vd} tokens" if directory is None else f"{directory}, {vd} tokens")
    return d2t


def _built_d2t(recipe: Recipe, source: Any, train_idx: list[int], vocab_size: int, tokenizer: Any,
               eos_ids: list[int]) -> torch.Tensor:
    """The draft vocab online training builds when none is stored: from the assistant tokens of the training
    split, keeping `vocab.forced_draft_ids`."""
    freq = torch.zeros(vocab_size, dtype=torch.long)
    for i in train_idx:
        s = source.sequence(i)
        freq += vocab_mod.token_frequencies(s["input_ids"], s["loss_mask"], vocab_size)
    forced = vocab_mod.forced_draft_ids(getattr(tokenizer, "all_special_ids", None) or [], eos_ids, source.manifest,
                                        vocab_size)
    d2t, _ = vocab_mod.build_vocab(freq, recipe.speculator.draft_vocab_size, forced)
    return d2t


def check_signature(resume: str, ckpt: Path, theirs: str | None, mine: str) -> None:
    """`resume: auto` continues a run only with the settings it was started with."""
    if resume == "auto" and theirs is not None and theirs != mine:
        raise SpeculatorsError(f"the checkpoints in {ckpt.parent} were trained with other settings (train signature "
                               f"{theirs}, this recipe {mine}); pass --force to retrain from scratch, or "
                               f"train.resume={ckpt} to continue from that checkpoint with the new settings")


def preflight(recipe: Recipe, *, force: bool = False) -> None:
    """The cheap checks of `train` without loading any weights (the launcher runs them before starting workers,
    so bad input fails with one line): family, training data, features from this target, draft vocab covers
    EOS, resume checkpoint of this family and target."""
    family = recipe.speculator.family
    check_family(family, " (speculator.family)")
    _check_training_options(recipe)
    tokenizer = load_tokenizer(recipe.target)
    config = AutoConfig.from_pretrained(recipe.target.name_or_path, revision=recipe.target.revision,
                                        trust_remote_code=recipe.target.trust_remote_code)
    fp = fingerprint_target(recipe.target, tokenizer, config).to_dict()
    vocab_size = int(text_config(config).vocab_size)
    if recipe.capture.mode == "offline":
        store = FeatureStore(recipe.paths.features)
        store.check_target(fp)
        store.verify_checksums()  # every shard, before any worker starts (one line naming a damaged shard)
    else:
        read_manifest(recipe.training_data_dir, "speculators.prepared/v1", "prepared data")
    checked_draft_vocab(recipe, vocab_size, eos_token_ids(config, tokenizer))
    if not force:
        ckpt = ck.find_resume(recipe.train.resume, recipe.paths.checkpoints)
        if ckpt is not None:
            theirs = family_of(read_speculator_config(ckpt))
            if theirs != family:
                raise SpeculatorsError(f"cannot resume from {ckpt}: it is a {theirs} checkpoint but the recipe trains "
                                       f"{family} (point train.resume at a {family} checkpoint, or use "
                                       "train.resume=never)")
            want = read_pairing(ckpt)["target"]
            if want["content_hash"] != fp["content_hash"] or want["tokenizer_hash"] != fp["tokenizer_hash"]:
                raise SpeculatorsError(f"cannot resume from {ckpt}: it was trained for {want['name_or_path']}@"
                                       f"{want['revision']} but the recipe's target is {fp['name_or_path']}@"
                                       f"{fp['revision']}")
            check_signature(recipe.train.resume, ckpt, ck.read_trainer_state(ckpt).get("signature"),
                             train_signature(recipe))


def _check_training_options(recipe: Recipe) -> None:
    t, spec = recipe.train, recipe.speculator
    if t.curve_points < 0 or not 0 < t.curve_share <= 1 or (t.curve_rows is not None and t.curve_rows < 1):
        raise SpeculatorsError(f"train.curve_points must be >= 0 (0: no learning curve), train.curve_share in (0, 1] "
                               f"and train.curve_rows >= 1 or unset; got {t.curve_points}, {t.curve_share}, "
                               f"{t.curve_rows}")
    check_optimizer_options(t)
    levers = [k for k in ("freeze_lm_head", "norm_from_target") if getattr(spec, k)]
    if levers and spec.family != "eagle3":
        raise SpeculatorsError(f"speculator.{levers[0]} is an eagle3 option (mtp always copies the target's head and "
                               f"final norm and keeps the head frozen); unset it for {spec.family}")
    if not 0 < t.teacher_temperature < float("inf"):
        raise SpeculatorsError(f"train.teacher_temperature must be > 0, got {t.teacher_temperature}")
    if t.teacher_rest_mass and (recipe.capture.mode != "offline" or recipe.capture.teacher != "topk"):
        raise SpeculatorsError("train.teacher_rest_mass applies to a stored top-k teacher (capture.mode: offline, "
                               "capture.teacher: topk); the other teachers are full distributions already")
    if t.teacher_rest_mass and t.teacher_temperature != 1.0:
        raise SpeculatorsError("train.teacher_rest_mass needs train.teacher_temperature 1: the mass outside the "
                               "stored top-k cannot be re-tempered")


def frozen_target_weights(cfg: Any) -> tuple[Any, Any] | None:
    """(HF config, TargetWeights) read from the checkpoint files alone — the embedding, lm_head and final norm —
    without loading the whole target (offline training of a 30B MoE needs 3 tensors, not 60 GB per rank).
    None when that is not possible (PEFT adapter, hub id not cached, no safetensors, unexpected names): the caller
    then loads the model."""
    if cfg.adapter or not is_local(cfg.name_or_path):
        return None
    directory = Path(cfg.name_or_path)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    elif (directory / "model.safetensors").is_file():
        with safe_open(str(directory / "model.safetensors"), framework="pt") as fh:
            weight_map = {k: "model.safetensors" for k in fh.keys()}  # noqa: SIM118
    else:
        return None
    config = AutoConfig.from_pretrained(str(directory), trust_remote_code=cfg.trust_remote_code)
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code)
    except Exception:  # noqa: BLE001 - exotic architectures: fall back to a full load
        return None
    names: dict[int, list[str]] = {}
    for n, p in skeleton.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    params = {"embed_tokens": input_embeddings(skeleton).weight, "lm_head": output_head(skeleton).weight,
              "final_norm": final_norm(skeleton).weight}
    tensors = {}
    for field_name, param in params.items():
        stored = [n for n in names.get(id(param), []) if n in weight_map]  # tied weights: any of the names
        if not stored:
            return None
        with safe_open(str(directory / weight_map[stored[0]]), framework="pt") as fh:
            tensors[field_name] = fh.get_tensor(stored[0]).float()
    return config, TargetWeights(**tensors)


def load_setup(recipe: Recipe, device: Any) -> Setup:
    """Target (weights, fingerprint), data source and split, draft vocab — validated, nothing written."""
    _check_training_options(recipe)
    mode = recipe.capture.mode
    store = None
    if mode == "offline":
        store = FeatureStore(recipe.paths.features)
        if os.environ.get(SHARDS_VERIFIED_ENV) != "1":  # the launcher's preflight already checked them
            store.verify_checksums()  # before step 1: a damaged shard fails now, not when an epoch reaches it
    else:
        source = PreparedSource(recipe.training_data_dir, recipe.data.max_length)
    frozen = frozen_target_weights(recipe.target) if mode == "offline" else None
    target_model = None
    if frozen is not None:  # offline: only the frozen tensors are needed
        model_config, weights = frozen
        tokenizer = load_tokenizer(recipe.target)
        generation_config = None
    else:
        target = load_target(recipe.target, device=str(device) if mode == "online" else "cpu")
        model_config, tokenizer = target.model.config, target.tokenizer
        weights = target_weights(target.model)
        generation_config = getattr(target.model, "generation_config", None)
        target_model = target.model if mode == "online" else None
    fp = fingerprint_target(recipe.target, tokenizer, model_config).to_dict()
    n_layers = int(text_config(model_config).num_hidden_layers)
    vocab_size = int(text_config(model_config).vocab_size)
    eos = eos_token_ids(generation_config, model_config, tokenizer)
    if store is not None:
        store.check_target(fp)
        source = FeatureSource(store)
        layer_ids = store.layer_ids
        if recipe.capture.layer_ids and layer_ids and list(recipe.capture.layer_ids) != list(layer_ids):
            raise SpeculatorsError(f"capture.layer_ids {recipe.capture.layer_ids} differ from the features' "
                                   f"{layer_ids} in {recipe.paths.features}; re-run capture --force")
    else:
        taps = SPECULATORS[recipe.speculator.family].capture_request(recipe.capture.layer_ids, n_layers).tap_layer_ids
        layer_ids = list(taps) if taps is not None else None
    train_idx, val_idx = train_val_indices(source, recipe.data.val_fraction, recipe.seed)
    d2t = checked_draft_vocab(recipe, vocab_size, eos,
                              lambda: _built_d2t(recipe, source, train_idx, vocab_size, tokenizer, eos))
    return Setup(model_config=model_config, weights=weights, fingerprint=fp, tokenizer=tokenizer,
                 layer_ids=layer_ids, d2t=d2t, source=source, train_idx=train_idx, val_idx=val_idx,
                 target_model=target_model, mode=mode, store=store)
