"""`speculators train`: one accelerate loop for every speculator family (the `train` pipeline stage).

What it does:
- `run(recipe, force=False)`: re-launches itself under `accelerate launch` when the recipe asks for several
  processes or an accelerate config (launch.py), else trains in this process (`train`). 1 CPU process, N CPU
  processes (gloo DDP), DeepSpeed ZeRO-2/3 (CPU or GPU) and FSDP (GPU) all run this same code.
- Data: offline feature shards (`speculators.data.shards.FeatureStore`, refused when captured from another target;
  every shard's sha256 is verified before step 1)
  or online capture (`capture.mode: online`: the target runs inside the step on the prepared/regenerated rows).
- The speculator comes from `SPECULATORS[family].from_target(...)`; the trainer never branches on the family.
- Optimisation: AdamW, warmup + cosine/linear/constant schedule (a pure function of the optimizer step),
  gradient accumulation, clipping, bf16 mixed precision on CUDA (fp32 on CPU); loss = `loss.speculator_loss`.
- Every `eval_every` / `save_every` steps and at the end: held-out teacher-forced per-step accuracy, chain reach,
  per-position acceptance and simulated tau (`speculators.metrics`), logged with a table + plot; checkpoints
  (checkpoint.py) with `best` chosen by that simulated tau. Exact resume of model, optimizer, schedule, data
  position and RNG (`train.resume`: auto | never | a path).
- The summary (steps, tokens/s per process, peak memory, final loss, val acceptance and tau, best checkpoint) is
  returned and written to `checkpoints/train-summary.json`; `is_complete` reads it back.

What it does not do: capture offline features (speculators.data.capture), evaluate on the held-out workloads or
with the live runtime (speculators.evaluate), export (speculators.export).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculators.config import Recipe, to_dict
from speculators.errors import SpeculatorsError

_NOT_IN_SIGNATURE = {"resume", "trackers", "wandb_project", "wandb_entity", "wandb_group", "wandb_tags", "log_every",
                     "num_workers", "eval_every", "keep_last", "accelerate_config", "num_processes", "save_every"}


# ----------------------------------------------------------------------------------------------------------------
# stage contract


# recipe options added after checkpoints already existed, with the default that reproduces the earlier training
_NEW_OPTIONS = {"loss": "kl", "teacher_temperature": 1.0, "teacher_rest_mass": False, "fc_norm": False,
                "norm_before_fc": False, "norm_output": False}


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


def is_complete(recipe: Recipe) -> bool:
    from speculators.train.checkpoint import SUMMARY_FILE, read_pointer

    root = recipe.paths.checkpoints
    try:
        summary = json.loads((root / SUMMARY_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return bool(summary.get("complete")) and summary.get("signature") == train_signature(recipe) and \
        read_pointer(root, "latest") is not None


def run(recipe: Recipe, *, force: bool = False) -> dict:
    from speculators.train.launch import launch, needs_launch

    if not force and is_complete(recipe):
        from speculators.train.checkpoint import SUMMARY_FILE

        summary = json.loads((recipe.paths.checkpoints / SUMMARY_FILE).read_text())
        summary["status"] = "complete (already trained; --force retrains)"
        return summary
    if needs_launch(recipe):
        return launch(recipe, force=force)
    return train(recipe, force=force)


# ----------------------------------------------------------------------------------------------------------------
# schedule


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """LR multiplier for optimizer step `step` (0-based): linear warmup to 1, then cosine/linear decay to
    `min_ratio` at `total`, or constant."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    raise SpeculatorsError(f"train.schedule: unknown schedule {schedule!r}; use cosine, linear or constant")


def warmup_steps(total: int, ratio: float) -> int:
    return int(math.ceil(total * ratio)) if ratio > 0 else 0


# ----------------------------------------------------------------------------------------------------------------
# environment


def _versions() -> dict:
    import platform

    import accelerate
    import torch
    import transformers

    import speculators

    out = {"speculators": getattr(speculators, "__version__", "0"), "torch": torch.__version__,
           "transformers": transformers.__version__, "accelerate": accelerate.__version__,
           "python": platform.python_version()}
    if "deepspeed" in sys.modules:
        out["deepspeed"] = sys.modules["deepspeed"].__version__
    return out


def peak_memory_mb(device: Any) -> float:
    """Peak memory of this process: CUDA max allocated on GPU, max RSS on CPU (MiB)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux: KiB


def _reset_accelerate_state() -> None:
    """A fresh accelerate state for in-process runs (tests, train-bench); launched workers start fresh anyway."""
    if os.environ.get("LOCAL_RANK") is not None or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def make_accelerator(recipe: Recipe) -> Any:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    _reset_accelerate_state()
    cuda = torch.cuda.is_available() and not recipe.target.device.startswith("cpu")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not cuda:
        raise SpeculatorsError("FSDP needs CUDA GPUs (accelerate runs FSDP on CPU undistributed); on CPU use "
                               "recipes/accelerate/cpu-ddp-2.yaml or deepspeed-zero2.yaml")
    precision = recipe.train.precision
    mixed = "bf16" if precision == "bf16" or (precision == "auto" and cuda) else "no"
    handlers: list[Any] = [DistributedDataParallelKwargs(find_unused_parameters=False)]
    kwargs: dict[str, Any] = {"gradient_accumulation_steps": recipe.train.grad_accum, "mixed_precision": mixed,
                              "step_scheduler_with_optimizer": False}
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if not cuda and deepspeed:
        # accelerate disables DeepSpeed under cpu=True; gloo keeps DeepSpeed and gives every rank its index
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    elif not cuda:
        kwargs["cpu"] = True
    return Accelerator(kwargs_handlers=handlers, **kwargs)


def _configure_deepspeed(acc: Any, recipe: Recipe) -> None:
    """Fill the "auto" entries of a DeepSpeed config from the recipe (no model config needed)."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    cfg = plugin.deepspeed_config
    t = recipe.train
    values = {"train_micro_batch_size_per_gpu": t.batch_size, "gradient_accumulation_steps": t.grad_accum,
              "gradient_clipping": t.grad_clip, "train_batch_size": t.batch_size * t.grad_accum * acc.num_processes}
    for key, value in values.items():
        if cfg.get(key, "auto") == "auto":
            cfg[key] = value
    zero = cfg.get("zero_optimization", {})
    for key in [k for k, v in zero.items() if v == "auto"]:
        raise SpeculatorsError(f"DeepSpeed config: zero_optimization.{key} is 'auto', which needs a model config; "
                               "give a number (see recipes/deepspeed/zero3.json)")


@contextlib.contextmanager
def _plain_init(acc: Any) -> Any:
    """Build the target and the speculator unpartitioned even under ZeRO-3 (accelerate registers its DeepSpeed
    config with transformers, which would otherwise load the target with zero.Init: empty local weights)."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


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


def target_eos_ids(model_config: Any, tokenizer: Any, generation_config: Any = None) -> list[int]:
    ids: set[int] = set()
    for src in (generation_config, model_config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None:
            ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def check_eos_covered(d2t: Any, eos_ids: list[int], where: str) -> None:
    import torch

    covered = set((torch.arange(d2t.shape[0]) + d2t.cpu()).tolist())
    missing = [e for e in eos_ids if e not in covered]
    if missing:
        raise SpeculatorsError(f"the draft vocabulary ({where}) does not cover the target's EOS token id(s) "
                               f"{missing}: the speculator could never propose the end of a turn; rebuild it with "
                               "EOS included (re-run capture) or raise speculator.draft_vocab_size")


def _online_d2t(recipe: Recipe, source: Any, train_idx: list[int], vocab_size: int, tokenizer: Any,
                eos_ids: list[int]) -> Any:
    """The draft vocab in online mode: the features dir's vocab file if capture wrote one, else built from the
    assistant tokens of the training split."""
    from speculators.data import vocab as vocab_mod

    vd = recipe.speculator.draft_vocab_size
    features = recipe.paths.features
    if vocab_mod.vocab_file(features, vd).is_file() or (features / vocab_mod.TOKEN_FREQ_FILE).is_file():
        d2t, _ = vocab_mod.load_vocab(features, vd)
        return d2t
    import torch

    freq = torch.zeros(vocab_size, dtype=torch.long)
    for i in train_idx:
        s = source.sequence(i)
        freq += vocab_mod.token_frequencies(s["input_ids"], s["loss_mask"], vocab_size)
    forced = set(eos_ids) | set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    forced |= set(int(i) for i in source.manifest.get("tokenizer", {}).get("end_of_turn_ids", []))
    forced = sorted(i for i in forced if 0 <= i < vocab_size)
    d2t, _ = vocab_mod.build_vocab(freq, vd, forced)
    return d2t


def _check_signature(resume: str, ckpt: Path, theirs: str | None, mine: str) -> None:
    """`resume: auto` continues a run only with the settings it was started with."""
    if resume == "auto" and theirs is not None and theirs != mine:
        raise SpeculatorsError(f"the checkpoints in {ckpt.parent} were trained with other settings (train signature "
                               f"{theirs}, this recipe {mine}); pass --force to retrain from scratch, or "
                               f"train.resume={ckpt} to continue from that checkpoint with the new settings")


def preflight(recipe: Recipe, *, force: bool = False) -> None:
    """The cheap checks of `train` without loading any weights (the launcher runs them before starting workers,
    so bad input fails with one line): family, training data, features from this target, draft vocab covers
    EOS, resume checkpoint of this family and target."""
    from transformers import AutoConfig

    from speculators.models import SPECULATORS
    from speculators.target import fingerprint_target, load_tokenizer, text_config
    from speculators.train import checkpoint as ck

    family = recipe.speculator.family
    SPECULATORS[family]  # noqa: B018 - unknown family -> SpeculatorsError
    _check_teacher_shape(recipe)
    tokenizer = load_tokenizer(recipe.target)
    config = AutoConfig.from_pretrained(recipe.target.name_or_path, revision=recipe.target.revision,
                                        trust_remote_code=recipe.target.trust_remote_code)
    fp = fingerprint_target(recipe.target, tokenizer, config).to_dict()
    vocab_size = int(text_config(config).vocab_size)
    vd = recipe.speculator.draft_vocab_size
    features = recipe.paths.features
    vocab_dir = None
    if recipe.capture.mode == "offline":
        from speculators.data.shards import FeatureStore

        store = FeatureStore(features)
        store.check_target(fp)
        store.verify_checksums()  # every shard, before any worker starts (one line naming a damaged shard)
        vocab_dir = features
    else:
        from speculators.data.artifacts import read_manifest

        read_manifest(recipe.training_data_dir, "speculators.prepared/v1", "prepared data")
        from speculators.data import vocab as vocab_mod

        if vd is not None and (vocab_mod.vocab_file(features, vd).is_file() or
                               (features / vocab_mod.TOKEN_FREQ_FILE).is_file()):
            vocab_dir = features
    if vd is not None and vd != vocab_size and vocab_dir is not None:
        from speculators.data.vocab import load_vocab

        d2t, _ = load_vocab(vocab_dir, vd)
        check_eos_covered(d2t, target_eos_ids(config, tokenizer), f"{vocab_dir}, {vd} tokens")
    if not force:
        ckpt = ck.find_resume(recipe.train.resume, recipe.paths.checkpoints)
        if ckpt is not None:
            from speculators.export.pairing import read_pairing
            from speculators.models.io import family_of, read_speculator_config

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
            _check_signature(recipe.train.resume, ckpt, ck.read_trainer_state(ckpt).get("signature"),
                             train_signature(recipe))


def _check_teacher_shape(recipe: Recipe) -> None:
    t = recipe.train
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
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from speculators.models.base import TargetWeights
    from speculators.target import final_norm, input_embeddings, is_local, output_head

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
    from speculators.models.io import target_weights
    from speculators.target import default_tap_layers, fingerprint_target, load_target, load_tokenizer, text_config
    from speculators.train.batches import FeatureSource, PreparedSource, split_indices

    mode = recipe.capture.mode
    store = None
    if mode == "offline":
        from speculators.data.shards import FeatureStore
        from speculators.train.launch import SHARDS_VERIFIED_ENV

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
    eos = target_eos_ids(model_config, tokenizer, generation_config)
    if store is not None:
        store.check_target(fp)
        source = FeatureSource(store)
        layer_ids = store.layer_ids
        if recipe.capture.layer_ids and layer_ids and list(recipe.capture.layer_ids) != list(layer_ids):
            raise SpeculatorsError(f"capture.layer_ids {recipe.capture.layer_ids} differ from the features' "
                                   f"{layer_ids} in {recipe.paths.features}; re-run capture --force")
    else:
        layer_ids = list(recipe.capture.layer_ids or default_tap_layers(n_layers))
    train_idx, val_idx = split_indices(len(source), recipe.data.val_fraction, recipe.seed)
    d2t = None
    vd = recipe.speculator.draft_vocab_size
    if vd is not None and vd != vocab_size:
        if store is not None:
            from speculators.data.vocab import load_vocab

            d2t, _ = load_vocab(recipe.paths.features, vd)
        else:
            d2t = _online_d2t(recipe, source, train_idx, vocab_size, tokenizer, eos)
        check_eos_covered(d2t, eos, f"{vd} tokens")
    return Setup(model_config=model_config, weights=weights, fingerprint=fp, tokenizer=tokenizer,
                 layer_ids=layer_ids, d2t=d2t, source=source, train_idx=train_idx, val_idx=val_idx,
                 target_model=target_model, mode=mode, store=store)


def _train_module_class() -> type:
    from torch import nn

    class _TrainModule(nn.Module):
        """Routes `forward` to the speculator's `forward_train`, so DDP / DeepSpeed / FSDP wrappers see a forward."""

        def __init__(self, spec: Any) -> None:
            super().__init__()
            self.spec = spec

        def forward(self, batch: dict) -> list:
            return self.spec.forward_train(batch)

    return _TrainModule


# ----------------------------------------------------------------------------------------------------------------
# the loop


@dataclass
class Plan:
    total_steps: int
    warmup: int
    batches_per_epoch: int


def _plan(recipe: Recipe, batches_per_epoch: int) -> Plan:
    t = recipe.train
    steps_per_epoch = max(1, batches_per_epoch // t.grad_accum)
    total = t.max_steps if t.max_steps is not None else max(1, int(math.ceil(t.epochs * steps_per_epoch)))
    if total < 1:
        raise SpeculatorsError(f"train.max_steps must be >= 1, got {total}")
    return Plan(total_steps=total, warmup=warmup_steps(total, t.warmup_ratio), batches_per_epoch=batches_per_epoch)


def _evaluate(acc: Any, model: Any, setup: Setup, features: Any, weights: list[float], vocab: Any,
              batch_size: int, pad_id: int) -> dict:
    """Held-out teacher-forced metrics: per-step top-1 / top-k accuracy, chain reach, per-position acceptance,
    simulated tau, KL. Every rank runs the same number of forwards (ZeRO-3 gathers parameters in forward)."""
    import torch

    from speculators.metrics import chain_reach, per_position_from_reach, simulated_tau
    from speculators.train.batches import load_batch
    from speculators.train.loss import TOPK, speculator_loss

    val = setup.val_idx
    if not val:
        return {}
    world, rank = acc.num_processes, acc.process_index
    mine = val[rank::world]
    per_rank = -(-len(val) // world)
    n_batches = -(-per_rank // batch_size)
    k_steps = len(weights)
    kl_sum = torch.zeros(k_steps, dtype=torch.float64)
    correct = torch.zeros(k_steps, dtype=torch.long)
    counted = torch.zeros(k_steps, dtype=torch.long)
    topk = torch.zeros(k_steps, TOPK, dtype=torch.long)
    alphas, valids = [], []
    model.eval()
    with torch.no_grad():
        for b in range(n_batches):
            idx = mine[b * batch_size:(b + 1) * batch_size]
            dummy = not idx
            batch = load_batch(setup.source, idx or [val[0]], pad_id)
            inputs, teacher = features(batch, acc.device)
            logits = model(inputs)
            if dummy:
                continue
            out = speculator_loss(logits, teacher, batch["loss_mask"].to(acc.device),
                                  batch["attention_mask"].to(acc.device), weights, vocab, with_alpha=True)
            kl_sum += torch.tensor(out.step_kl, dtype=torch.float64) * out.counted.double()
            correct += out.correct
            counted += out.counted
            topk += out.topk_correct
            rows = out.valid[..., 0]  # [B, T]
            alphas.append(out.alpha[rows])  # [n, K]
            valids.append(out.valid[rows])
    model.train()
    dev = acc.device
    alpha = torch.cat(alphas) if alphas else torch.zeros(0, k_steps)
    valid = torch.cat(valids) if valids else torch.zeros(0, k_steps, dtype=torch.bool)
    alpha = acc.gather(acc.pad_across_processes(alpha.to(dev), dim=0)).cpu()
    valid = acc.gather(acc.pad_across_processes(valid.to(torch.uint8).to(dev), dim=0)).cpu().bool()
    sums = acc.reduce(torch.cat([kl_sum, correct.double(), counted.double(), topk.double().flatten()]).to(dev),
                      reduction="sum").cpu()
    kl_sum, correct, counted = sums[:k_steps], sums[k_steps:2 * k_steps], sums[2 * k_steps:3 * k_steps]
    topk = sums[3 * k_steps:].view(k_steps, TOPK)
    reach = chain_reach(alpha, valid)
    per_pos = per_position_from_reach(reach)
    denom = counted.clamp_min(1)
    top1 = (correct / denom).tolist()
    kl = (kl_sum / denom).tolist()
    return {
        "val_loss": float(sum(w * v for w, v in zip(weights, kl, strict=False))),
        "val_kl": [round(v, 5) for v in kl],
        "val_top1_accuracy": [round(v, 5) for v in top1],
        "val_topk_accuracy": (topk / denom[:, None]).tolist(),
        "chain_reach": [round(v, 5) for v in reach],
        "per_position_acceptance": [round(v, 5) for v in per_pos],
        "simulated_tau": round(simulated_tau(per_pos), 5),
        "val_positions": int(counted[0]),
    }


def _acceptance_rows(ev: dict) -> list[dict]:
    return [{"k": k + 1, "acceptance": a, "chain_reach": e, "top1_accuracy": t}
            for k, (a, e, t) in enumerate(zip(ev["per_position_acceptance"], ev["chain_reach"],
                                              ev["val_top1_accuracy"], strict=False))]


def train(recipe: Recipe, *, force: bool = False) -> dict:
    """Train in this process (one rank of a launched job, or the only process)."""
    import torch
    from accelerate.utils import DistributedType, set_seed

    from speculators.models import SPECULATORS
    from speculators.train import checkpoint as ck
    from speculators.train.batches import BatchPlan, OfflineFeatures, OnlineFeatures, micro_batch_loader
    from speculators.train.loss import TeacherShape, VocabMap, speculator_loss
    from speculators.train.tracking import Tracker, wandb_options

    t = recipe.train
    family = recipe.speculator.family
    spec_cls = SPECULATORS[family]
    if t.batch_size < 1 or t.grad_accum < 1:
        raise SpeculatorsError("train.batch_size and train.grad_accum must be >= 1")
    acc = make_accelerator(recipe)
    world, rank, main = acc.num_processes, acc.process_index, acc.is_main_process
    root = recipe.paths.checkpoints

    # ---- validate everything before writing anything ----------------------------------------------------------
    resume_dir = None if force else ck.find_resume(t.resume, root)
    with _plain_init(acc):
        setup = load_setup(recipe, acc.device)
        set_seed(recipe.seed)
        spec = spec_cls.from_target(setup.model_config, recipe.speculator, setup.weights, setup.layer_ids,
                                    setup.d2t)
    trainable = {n: tuple(p.shape) for n, p in spec.named_parameters() if p.requires_grad}
    if not trainable:
        raise SpeculatorsError(f"the {family} speculator has no trainable parameters")
    state: dict = {}
    if resume_dir is not None:
        state = ck.check_resume(resume_dir, family, setup.fingerprint, trainable)
        _check_signature(t.resume, resume_dir, state.get("signature"), train_signature(recipe))
        if state.get("world_size", world) != world and acc.distributed_type == DistributedType.DEEPSPEED:
            raise SpeculatorsError(f"cannot resume {resume_dir} with {world} DeepSpeed processes: it was written "
                                   f"by {state.get('world_size')} (ZeRO shards are per rank)")
    req = spec.required_features()
    vocab = VocabMap.build(spec.draft_to_target.cpu(), setup.weights.lm_head.shape[0])
    pad_id = 0
    plan_data = BatchPlan(setup.train_idx, setup.source.lengths(), t.batch_size, recipe.seed, rank, world)
    plan = _plan(recipe, plan_data.batches_per_epoch)

    # ---- from here on we write ----------------------------------------------------------------------------------
    if main:
        if force and root.exists():
            ck.remove_dir(root)
        ck.clean_partial(root)
    acc.wait_for_everyone()

    module = _train_module_class()(spec)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    _configure_deepspeed(acc, recipe)
    model, optimizer = acc.prepare(module, optimizer)
    deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
    writer = ck.CheckpointWriter(root, acc, t.keep_last)
    writer.install_hooks(model)
    if resume_dir is not None:
        writer.load_state(resume_dir)
    start_step = int(state.get("step", 0))
    micro = int(state.get("micro_step", 0))
    tokens_total = int(state.get("tokens", 0))
    best = state.get("best") or {}
    history: list[dict] = list(state.get("history", []))

    device = acc.device
    shape = TeacherShape(temperature=t.teacher_temperature, rest_mass=t.teacher_rest_mass)
    if setup.mode == "online":
        features = OnlineFeatures(setup.target_model, req, vocab.to(device), shape)
    else:
        lm_head = setup.weights.lm_head.to(device) if setup.store.teacher == "hidden" else None
        features = OfflineFeatures(lm_head, bool(req.tap_layer_ids), req.last_hidden, vocab.to(device), shape)
    vocab_dev = vocab.to(device)
    weights = spec.step_weights(recipe.speculator.step_loss_decay)
    unwrapped = acc.unwrap_model(model).spec
    fp = setup.fingerprint
    recipe_dict = to_dict(recipe)
    versions = _versions()
    tracker = Tracker(recipe.paths.logs, t.trackers, run_name=recipe.name, enabled=main,
                      resume_step=start_step if resume_dir is not None else None, wandb=wandb_options(t),
                      config={**recipe_dict, "world_size": world, "mode": setup.mode})
    sharded = (deepspeed and int(acc.state.deepspeed_plugin.zero_stage) == 3) or \
        acc.distributed_type == DistributedType.FSDP

    def spec_for_save() -> Any:
        if not sharded:
            return unwrapped
        full = acc.get_state_dict(model)  # collective: gathers ZeRO-3 / FSDP shards
        if not main:
            return None
        copy = spec_cls.from_config_dict(unwrapped.config_dict())
        copy.target_tensors = dict(getattr(unwrapped, "target_tensors", {}) or {})
        copy.load_state_dict({k.removeprefix("spec."): v for k, v in full.items()}, strict=False)
        return copy

    def evaluate_and_log(step: int) -> dict:
        ev = _evaluate(acc, model, setup, features, weights, vocab_dev, t.batch_size, pad_id)
        if not ev:
            return ev
        set_tree = getattr(unwrapped, "set_choices_from_accuracy", None)  # static-tree families (Medusa)
        if callable(set_tree):
            set_tree(ev["val_topk_accuracy"], recipe.serve.tree.budget)
        ev["step"] = step
        png = recipe.paths.logs / "plots" / f"acceptance-{ck.step_name(step)}.png"
        tracker.log_acceptance(step, _acceptance_rows(ev), {k: v for k, v in ev.items()
                                                            if k not in ("val_topk_accuracy",)}, png if main else None)
        return ev

    def save(step: int, ev: dict) -> Path:
        nonlocal best
        tau = ev.get("simulated_tau") if ev else None
        is_best = tau is not None and (not best or tau > float(best.get("simulated_tau", -1.0)))
        if is_best:
            best = {"step": step, "simulated_tau": tau, "checkpoint": ck.step_name(step)}
        trainer_state = {"step": step, "micro_step": micro, "tokens": tokens_total, "world_size": world,
                         "best": best, "history": history[-50:], "signature": train_signature(recipe),
                         "total_steps": plan.total_steps}
        metadata = {"family": family, "recipe": recipe_dict, "versions": versions, "step": step, "target": fp,
                    "training": {"validation": {k: v for k, v in (ev or {}).items() if k != "val_topk_accuracy"}}}
        evaluation = {"kind": "teacher-forced validation (train split held out)", "step": step,
                      "simulated_tau": tau, "per_position_acceptance": (ev or {}).get("per_position_acceptance")}
        return writer.save(step, spec_for_save, metadata=metadata, target_fp=fp, layer_ids=setup.layer_ids,
                           recipe=recipe_dict, trainer_state=trainer_state, evaluation=evaluation, is_best=is_best)

    # ---- train --------------------------------------------------------------------------------------------------
    from tqdm.auto import tqdm

    step = start_step
    bar = tqdm(total=plan.total_steps, initial=step, disable=not main, desc=f"train {family}", file=sys.stderr,
               dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 30.0)
    run_tokens = 0
    train_seconds = 0.0
    train_cpu_seconds = 0.0  # CPU time of all threads of this process (robust to other load on a shared machine)
    window_loss, window_n = 0.0, 0
    window_correct = torch.zeros(spec.num_steps, dtype=torch.long)
    window_counted = torch.zeros(spec.num_steps, dtype=torch.long)
    window_tokens, window_t0 = 0, time.perf_counter()
    last_loss = float("nan")
    grad_norm = None
    last_eval: dict = history[-1] if history else {}
    last_saved = start_step if resume_dir is not None else -1
    first_batch: list[int] = []
    loader = iter(micro_batch_loader(setup.source, plan_data, micro, (plan.total_steps - step) * t.grad_accum,
                                     t.num_workers, pad_id))
    model.train()
    while step < plan.total_steps:
        t0, c0 = time.perf_counter(), time.process_time()
        indices, batch = next(loader)
        first_batch = first_batch or list(indices)
        inputs, teacher = features(batch, device)
        with acc.accumulate(model):
            sync = acc.sync_gradients
            if sync:
                lr = t.lr * lr_factor(step, plan.total_steps, plan.warmup, t.schedule, t.min_lr_ratio)
                for group in optimizer.param_groups:
                    group["lr"] = lr
            logits = model(inputs)
            out = speculator_loss(logits, teacher, batch["loss_mask"].to(device), batch["attention_mask"].to(device),
                                  weights, vocab_dev, kind=t.loss)
            acc.backward(out.loss)
            if sync:
                if deepspeed:
                    gn = model.get_global_grad_norm()
                    grad_norm = float(gn) if gn is not None else None
                elif t.grad_clip and t.grad_clip > 0:
                    grad_norm = float(acc.clip_grad_norm_(params, t.grad_clip))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        micro += 1
        n_tok = int(batch["attention_mask"].sum())
        run_tokens += n_tok
        tokens_total += n_tok
        window_tokens += n_tok
        window_loss += float(out.loss.detach())
        window_n += 1
        window_correct += out.correct
        window_counted += out.counted
        train_seconds += time.perf_counter() - t0
        train_cpu_seconds += time.process_time() - c0
        if not sync:
            continue
        step += 1
        bar.update(1)
        if step % max(1, t.log_every) == 0 or step == plan.total_steps:
            stats = acc.reduce(torch.cat([torch.tensor([window_loss, float(window_n)], dtype=torch.float64),
                                          window_correct.double(), window_counted.double()]).to(device),
                               reduction="sum").cpu()
            last_loss = float(stats[0] / stats[1])
            k = spec.num_steps
            accs = (stats[2:2 + k] / stats[2 + k:2 + 2 * k].clamp_min(1)).tolist()
            elapsed = time.perf_counter() - window_t0
            metrics = {"loss": last_loss, "top1_accuracy": [round(a, 5) for a in accs],
                       "lr": optimizer.param_groups[0]["lr"], "tokens_per_s": round(window_tokens / elapsed, 1),
                       "epoch": round(micro / plan.batches_per_epoch, 4)}
            if grad_norm is not None and math.isfinite(grad_norm):
                metrics["grad_norm"] = grad_norm
            tracker.log(metrics, step)
            bar.set_postfix(loss=f"{last_loss:.4f}", acc0=f"{accs[0]:.3f}")
            if not math.isfinite(last_loss):
                raise SpeculatorsError(f"training diverged at step {step} (loss {last_loss}); lower train.lr or "
                                       "check the features for NaN/Inf")
            window_loss, window_n, window_tokens, window_t0 = 0.0, 0, 0, time.perf_counter()
            window_correct.zero_()
            window_counted.zero_()
        final = step == plan.total_steps
        do_save = final or (t.save_every > 0 and step % t.save_every == 0)
        if final or do_save or (t.eval_every > 0 and step % t.eval_every == 0):
            last_eval = evaluate_and_log(step)
            if last_eval:
                history.append({k: v for k, v in last_eval.items() if k != "val_topk_accuracy"})
        if do_save:
            save(step, last_eval)
            last_saved = step
    bar.close()
    if last_saved != step:  # resumed at the very end: nothing left to train, the final checkpoint exists
        last_eval = last_eval or evaluate_and_log(step)

    summary = {
        "status": "done", "family": family, "mode": setup.mode, "steps": step, "total_steps": plan.total_steps,
        "resumed_from_step": start_step if resume_dir is not None else None, "processes": world,
        "distributed": str(acc.distributed_type).split(".")[-1], "precision": acc.mixed_precision,
        "tokens_trained_this_run_per_process": run_tokens,
        "tokens_per_s_per_process": round(run_tokens / train_seconds, 1) if train_seconds > 0 else None,
        "tokens_per_cpu_second": round(run_tokens / train_cpu_seconds, 1) if train_cpu_seconds > 0 else None,
        "peak_memory_mb": peak_memory_mb(device), "final_loss": round(last_loss, 5) if math.isfinite(last_loss)
        else None,
        "val_top1_accuracy": last_eval.get("val_top1_accuracy"),
        "val_per_position_acceptance": last_eval.get("per_position_acceptance"),
        "val_simulated_tau": last_eval.get("simulated_tau"),
        "best_checkpoint": str(root / best["checkpoint"]) if best else None,
        "best_simulated_tau": best.get("simulated_tau") if best else None,
        "latest_checkpoint": str(root / ck.step_name(step)),
        "train_seconds": round(train_seconds, 1), "signature": train_signature(recipe), "complete": True,
    }
    mem = acc.gather(torch.tensor([summary["peak_memory_mb"]], dtype=torch.float64, device=device)).cpu()
    summary["peak_memory_mb_max_process"] = float(mem.max())
    firsts = torch.full((t.batch_size,), -1, dtype=torch.long)
    firsts[:len(first_batch)] = torch.tensor(first_batch, dtype=torch.long)
    gathered = acc.gather(firsts.to(device)).cpu().view(world, t.batch_size)
    summary["first_batch_per_process"] = [[i for i in row if i >= 0] for row in gathered.tolist()]
    tracker.log({k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}, step,
                kind="summary")
    tracker.close()
    if main:
        ck.write_text_atomic(root / ck.SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    if world > 1:  # every rank returns rank 0's summary (each node's launcher reports it, shared storage or not)
        from accelerate.utils import broadcast_object_list

        summary = broadcast_object_list([summary if main else None], from_process=0)[0]
    acc.wait_for_everyone()
    return summary
