"""The training loop: one accelerate loop for every speculator family (the stage's entry is `train/train.py`).

What it does:
- `train(recipe, force=False)` trains in this process; under `accelerate launch` (launch.py) every rank runs it.
  1 CPU process, N CPU processes (gloo DDP), DeepSpeed ZeRO-2/3 (CPU or GPU) and FSDP (GPU) all run this same code.
- Data: offline feature shards (`speculators.data.shards.FeatureStore`, refused when captured from another target;
  every shard's sha256 is verified before step 1)
  or online capture (`capture.mode: online`: the target runs inside the step on the prepared/regenerated rows).
- The speculator comes from `SPECULATORS[family].from_target(...)`; the trainer never branches on the family.
- Optimisation: AdamW (or Muon on the matrices, optimizer.py), warmup + cosine/linear/constant schedule
  (transformers' `get_scheduler`, fast-forwarded on resume),
  gradient accumulation, clipping, bf16 mixed precision on CUDA by default and on the CPU with
  `train.precision: bf16` (accelerate's autocast: bf16 matmuls, fp32 weights, loss and optimizer states), fp32
  otherwise; loss = `loss.speculator_loss`.
- Every `eval_every` / `save_every` steps and at the end: held-out teacher-forced per-step accuracy, chain reach,
  per-position acceptance and simulated tau (`speculators.core.metrics`), logged with a table + plot; checkpoints
  (checkpoint.py) with `best` chosen by that simulated tau. Exact resume of model, optimizer, schedule, data
  position and RNG (`train.resume`: auto | never | a path).
- The learning curve (learning_curve.py): held-out simulated tau at cycle starts, T = 0 and T = 1, against
  training seconds and tokens, at `train.curve_points` steps on a fixed held-out slice sized for <= `curve_share`
  of the training time; logged, drawn and written to `checkpoints/learning-curve.json` / `.png`.
- The summary (steps, tokens/s per process, peak memory, final loss, val acceptance and tau, best checkpoint) is
  returned and written to `checkpoints/train-summary.json`; `stage.is_complete` reads it back.

Read top to bottom: `train` = `_open` (validate, then wrap model and optimizer, restore a resume) -> `_run_steps`
(one `_micro_step` per micro-batch, `_log_window`, evaluation and checkpoints) -> `_finish` (the summary).

What it does not do: load the target and data (setup.py), build the accelerator (accelerator.py), compute the
held-out metrics (validation.py), write checkpoint folders (checkpoint.py), capture offline features
(speculators.data.capture), evaluate on the held-out workloads or with the live runtime (speculators.evaluate),
export (speculators.export).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType, broadcast_object_list, set_seed
from torch.optim.lr_scheduler import LambdaLR
from tqdm.auto import tqdm

from speculators.core.atomic import write_text_atomic
from speculators.core.checkpoints import step_name
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.recipes import to_dict
from speculators.core.tracking import Tracker, wandb_options
from speculators.models import SPECULATORS
from speculators.train import checkpoint as ck
from speculators.train.accelerator import (
    configure_deepspeed,
    make_accelerator,
    package_versions,
    peak_memory_mb,
    plain_init,
    train_module_class,
)
from speculators.train.batches import BatchPlan, OfflineFeatures, OnlineFeatures, micro_batch_loader
from speculators.train.checkpoint import SUMMARY_FILE
from speculators.train.init_from import load_init_weights
from speculators.train.learning_curve import LearningCurve, open_curve
from speculators.train.loss import TeacherShape, VocabMap, speculator_loss
from speculators.train.optimizer import build_optimizer
from speculators.train.schedule import lr_schedule, warmup_steps
from speculators.train.setup import Setup, check_signature, load_setup, train_signature
from speculators.train.validation import acceptance_rows, evaluate_heldout

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


@dataclass
class _Session:
    """One training run in this process: the prepared model and what the steps, evaluations and saves share."""

    recipe: Recipe
    acc: Any  # accelerate.Accelerator
    model: Any  # the (DDP / DeepSpeed / FSDP-wrapped) train module
    optimizer: Any
    scheduler: LambdaLR  # `lr_schedule`
    params: list  # trainable parameters (clipping)
    setup: Setup
    spec_cls: type
    spec: Any  # the speculator inside the wrappers
    features: Any  # OfflineFeatures | OnlineFeatures: batch -> (inputs, teacher)
    weights: list[float]  # per-step loss weights
    vocab: Any  # VocabMap on the device
    tracker: Any
    writer: Any  # checkpoint.CheckpointWriter
    plan: Plan
    batch_plan: Any  # batches.BatchPlan of this rank
    sharded: bool  # ZeRO-3 / FSDP: saving gathers the shards
    resume_dir: Path | None
    state: dict  # the resumed trainer state ({} for a fresh run)
    step: int = 0
    micro: int = 0
    tokens: int = 0
    best: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    lr: float = 0.0  # of the last optimizer step
    pad_id: int = 0
    versions: dict = field(default_factory=dict)
    curve: LearningCurve | None = None  # learning_curve.py: held-out tau at cycle starts over the run
    validation_seconds: float = 0.0  # spent in `evaluate_and_log` (the curve's own time is the curve's)

    @property
    def main(self) -> bool:
        return bool(self.acc.is_main_process)

    def spec_for_save(self) -> Any:
        """The speculator to write (rank 0); with sharded weights every rank joins the gather, others get None."""
        if not self.sharded:
            return self.spec
        full = self.acc.get_state_dict(self.model)  # collective: gathers ZeRO-3 / FSDP shards
        if not self.main:
            return None
        copy = self.spec_cls.from_config_dict(self.spec.config_dict())
        copy.target_tensors = dict(getattr(self.spec, "target_tensors", {}) or {})
        copy.load_state_dict({k.removeprefix("spec."): v for k, v in full.items()}, strict=False)
        return copy

    def evaluate_and_log(self, step: int) -> dict:
        """Held-out teacher-forced evaluation at `step`, logged with its table and plot ({} without held-out rows)."""
        t0 = time.perf_counter()
        ev = evaluate_heldout(self.acc, self.model, self.setup, self.features, self.weights, self.vocab,
                              self.recipe.train.batch_size, self.pad_id)
        self.validation_seconds += time.perf_counter() - t0
        if not ev:
            return ev
        set_tree = getattr(self.spec, "set_choices_from_accuracy", None)  # static-tree families (Medusa)
        if callable(set_tree):
            set_tree(ev["val_topk_accuracy"], self.recipe.serve.tree.budget)
        ev["step"] = step
        png = self.recipe.paths.logs / "plots" / f"acceptance-{step_name(step)}.png"
        self.tracker.log_acceptance(step, acceptance_rows(ev), {k: v for k, v in ev.items()
                                                                 if k != "val_topk_accuracy"}, png if self.main else None)
        return ev

    def save(self, step: int, ev: dict) -> Path:
        """Write the checkpoint of `step` (best when its held-out simulated tau is the highest so far)."""
        recipe, fp = self.recipe, self.setup.fingerprint
        tau = ev.get("simulated_tau") if ev else None
        is_best = tau is not None and (not self.best or tau > float(self.best.get("simulated_tau", -1.0)))
        if is_best:
            self.best = {"step": step, "simulated_tau": tau, "checkpoint": step_name(step)}
        trainer_state = {"step": step, "micro_step": self.micro, "tokens": self.tokens,
                         "world_size": self.acc.num_processes, "best": self.best, "history": self.history[-50:],
                         "signature": train_signature(recipe), "total_steps": self.plan.total_steps}
        recipe_dict = to_dict(recipe)
        metadata = {"family": recipe.speculator.family, "recipe": recipe_dict, "versions": self.versions,
                    "step": step, "target": fp,
                    "training": {"validation": {k: v for k, v in (ev or {}).items() if k != "val_topk_accuracy"}}}
        evaluation = {"kind": "teacher-forced validation (train split held out)", "step": step,
                      "simulated_tau": tau, "per_position_acceptance": (ev or {}).get("per_position_acceptance")}
        return self.writer.save(step, self.spec_for_save, metadata=metadata, target_fp=fp,
                                layer_ids=self.setup.layer_ids, recipe=recipe_dict, trainer_state=trainer_state,
                                evaluation=evaluation, is_best=is_best)


@dataclass
class _Window:
    """Training statistics since the last log line, summed over micro-batches (reduced over ranks when logged)."""

    num_steps: int
    loss: float = 0.0
    batches: int = 0
    tokens: int = 0
    t0: float = field(default_factory=time.perf_counter)
    correct: Any = None  # [K] long: correct greedy draft tokens per step
    counted: Any = None  # [K] long: scored positions per step

    def __post_init__(self) -> None:
        self.correct = torch.zeros(self.num_steps, dtype=torch.long)
        self.counted = torch.zeros(self.num_steps, dtype=torch.long)

    def add(self, loss: float, correct: Any, counted: Any, tokens: int) -> None:
        self.loss += loss
        self.batches += 1
        self.tokens += tokens
        self.correct += correct
        self.counted += counted

    def close(self, acc: Any) -> tuple[float, list[float], float]:
        """(mean loss, top-1 accuracy per step, tokens/s of this rank) over every rank; starts a new window."""
        stats = acc.reduce(torch.cat([torch.tensor([self.loss, float(self.batches)], dtype=torch.float64),
                                      self.correct.double(), self.counted.double()]).to(acc.device),
                           reduction="sum").cpu()
        k = self.num_steps
        loss = float(stats[0] / stats[1])
        accs = (stats[2:2 + k] / stats[2 + k:2 + 2 * k].clamp_min(1)).tolist()
        rate = self.tokens / (time.perf_counter() - self.t0)
        self.loss, self.batches, self.tokens, self.t0 = 0.0, 0, 0, time.perf_counter()
        self.correct.zero_()
        self.counted.zero_()
        return loss, accs, rate


@dataclass
class _Totals:
    """What the steps of this run measured (the summary's figures)."""

    tokens: int = 0  # trained by this process in this run
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # CPU time of all threads of this process (robust to other load on a shared machine)
    last_loss: float = float("nan")
    last_eval: dict = field(default_factory=dict)
    first_batch: list[int] = field(default_factory=list)


def train(recipe: Recipe, *, force: bool = False) -> dict:
    """Train in this process (one rank of a launched job, or the only process) and return the summary."""
    session = _open(recipe, force)
    totals = _run_steps(session)
    return _finish(session, totals)


def _validated(recipe: Recipe, acc: Any, force: bool) -> tuple[Setup, Any, Path | None, dict]:
    """Everything checked before anything is written: (setup, fresh speculator, resume dir, resumed state)."""
    t, family = recipe.train, recipe.speculator.family
    resume_dir = None if force else ck.find_resume(t.resume, recipe.paths.checkpoints)
    with plain_init(acc):
        setup = load_setup(recipe, acc.device)
        set_seed(recipe.seed)
        spec = SPECULATORS[family].from_target(setup.model_config, recipe.speculator, setup.weights,
                                               setup.layer_ids, setup.d2t)
    trainable = {n: tuple(p.shape) for n, p in spec.named_parameters() if p.requires_grad}
    if not trainable:
        raise SpeculatorsError(f"the {family} speculator has no trainable parameters")
    state: dict = {}
    if t.init_from and resume_dir is None:  # a resumed run holds its own weights already
        load_init_weights(spec, t.init_from, setup.fingerprint, setup.weights)
    if resume_dir is not None:
        state = ck.check_resume(resume_dir, family, setup.fingerprint, trainable)
        check_signature(t.resume, resume_dir, state.get("signature"), train_signature(recipe))
        world = acc.num_processes
        if state.get("world_size", world) != world and acc.distributed_type == DistributedType.DEEPSPEED:
            raise SpeculatorsError(f"cannot resume {resume_dir} with {world} DeepSpeed processes: it was written "
                                   f"by {state.get('world_size')} (ZeRO shards are per rank)")
    return setup, spec, resume_dir, state


def _open(recipe: Recipe, force: bool) -> _Session:
    """Validate, then prepare the run: clean the checkpoint dir, wrap model and optimizer, restore a resume."""
    t, root = recipe.train, recipe.paths.checkpoints
    acc = make_accelerator(recipe)
    setup, spec, resume_dir, state = _validated(recipe, acc, force)
    req = spec.required_features()
    vocab = VocabMap.build(spec.draft_to_target.cpu(), setup.weights.lm_head.shape[0])
    batch_plan = BatchPlan(setup.train_idx, setup.source.lengths(), t.batch_size, recipe.seed, acc.process_index,
                           acc.num_processes)
    plan = _plan(recipe, batch_plan.batches_per_epoch)
    # ---- from here on we write ----
    if acc.is_main_process:
        if force and root.exists():
            ck.remove_checkpoint_dir(root)
        ck.clean_partial(root)
    acc.wait_for_everyone()
    module = train_module_class()(spec)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = build_optimizer(module, t)
    configure_deepspeed(acc, recipe)
    model, optimizer = acc.prepare(module, optimizer)
    writer = ck.CheckpointWriter(root, acc, t.keep_last)
    writer.install_hooks(model)
    if resume_dir is not None:
        writer.load_state(resume_dir)
    shape = TeacherShape(temperature=t.teacher_temperature, rest_mass=t.teacher_rest_mass)
    vocab_dev = vocab.to(acc.device)
    if setup.mode == "online":
        features = OnlineFeatures(setup.target_model, req, vocab_dev, shape)
    else:
        lm_head = setup.weights.lm_head.to(acc.device) if setup.store.teacher == "hidden" else None
        features = OfflineFeatures(lm_head, bool(req.tap_layer_ids), req.last_hidden, vocab_dev, shape)
    start = int(state.get("step", 0))
    scheduler = lr_schedule(optimizer, t, plan.total_steps, plan.warmup, start)
    tracker = Tracker(recipe.paths.logs, t.trackers, run_name=recipe.name, enabled=acc.is_main_process,
                      resume_step=start if resume_dir is not None else None, wandb=wandb_options(t),
                      config={**to_dict(recipe), "world_size": acc.num_processes, "mode": setup.mode})
    curve = open_curve(recipe, setup, spec.num_steps, plan.total_steps, start if resume_dir is not None else 0,
                       tracker, acc.num_processes)
    sharded = (acc.distributed_type == DistributedType.DEEPSPEED and
               int(acc.state.deepspeed_plugin.zero_stage) == 3) or acc.distributed_type == DistributedType.FSDP
    return _Session(recipe=recipe, acc=acc, model=model, optimizer=optimizer, scheduler=scheduler, params=params, setup=setup,
                    spec_cls=SPECULATORS[recipe.speculator.family], spec=acc.unwrap_model(model).spec,
                    features=features, weights=spec.step_weights(recipe.speculator.step_loss_decay), vocab=vocab_dev,
                    tracker=tracker, writer=writer, plan=plan, batch_plan=batch_plan, sharded=sharded,
                    resume_dir=resume_dir, state=state, step=start, micro=int(state.get("micro_step", 0)),
                    tokens=int(state.get("tokens", 0)), best=state.get("best") or {},
                    history=list(state.get("history", [])), versions=package_versions(), curve=curve)


def _micro_step(s: _Session, batch: dict) -> tuple[Any, bool, float | None]:
    """Forward + backward of one micro-batch (an optimizer step when accumulation syncs):
    (loss output, synced, grad norm or None)."""
    t, device, grad_norm = s.recipe.train, s.acc.device, None
    inputs, teacher = s.features(batch, device)
    loss_mask, attention_mask = batch["loss_mask"].to(device), batch["attention_mask"].to(device)
    inputs["head_rows"] = rows = s.spec.train_rows(loss_mask, attention_mask)  # the head only where it counts
    with s.acc.accumulate(s.model):
        sync = s.acc.sync_gradients
        if sync:
            s.lr = float(s.optimizer.param_groups[0]["lr"])  # this step's, from `lr_schedule`
        weight = batch["position_weight"].to(device) if "position_weight" in batch else None  # [B, T] | None
        out = speculator_loss(s.model(inputs), teacher, loss_mask, attention_mask, s.weights, s.vocab, kind=t.loss,
                              rows=rows, position_weight=weight)
        s.acc.backward(out.loss)
        if sync:
            if s.acc.distributed_type == DistributedType.DEEPSPEED:
                gn = s.model.get_global_grad_norm()
                grad_norm = float(gn) if gn is not None else None
            elif t.grad_clip and t.grad_clip > 0:
                grad_norm = float(s.acc.clip_grad_norm_(s.params, t.grad_clip))
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        if sync:
            s.scheduler.step()
    return out, sync, grad_norm


def _log_window(s: _Session, window: _Window, grad_norm: float | None, bar: Any) -> float:
    """Log the window's loss / accuracy / lr / throughput; a non-finite loss stops training. Returns the loss."""
    loss, accs, rate = window.close(s.acc)
    metrics = {"loss": loss, "top1_accuracy": [round(a, 5) for a in accs],
               "lr": s.lr, "tokens_per_s": round(rate, 1),
               "epoch": round(s.micro / s.plan.batches_per_epoch, 4)}
    if grad_norm is not None and math.isfinite(grad_norm):
        metrics["grad_norm"] = grad_norm
    s.tracker.log(metrics, s.step)
    bar.set_postfix(loss=f"{loss:.4f}", acc0=f"{accs[0]:.3f}")
    if not math.isfinite(loss):
        raise SpeculatorsError(f"training diverged at step {s.step} (loss {loss}); lower train.lr or check the "
                               "features for NaN/Inf")
    return loss


def _run_steps(s: _Session) -> _Totals:
    """The optimizer steps from the resumed step to the plan's total, with logging, evaluation and checkpoints."""
    t, totals, total = s.recipe.train, _Totals(), s.plan.total_steps
    totals.last_eval = s.history[-1] if s.history else {}
    bar = tqdm(total=total, initial=s.step, disable=not s.main, desc=f"train {s.recipe.speculator.family}",
               file=sys.stderr, dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 30.0)
    window = _Window(s.spec.num_steps)
    last_saved = s.step if s.resume_dir is not None else -1
    loader = iter(micro_batch_loader(s.setup.source, s.batch_plan, s.micro, (total - s.step) * t.grad_accum,
                                     t.num_workers, s.pad_id))
    s.model.train()
    s.curve.maybe_measure(s, totals.seconds, totals.cpu_seconds)  # the start (a fresh run's step 0)
    while s.step < total:
        t0, c0 = time.perf_counter(), time.process_time()
        indices, batch = next(loader)
        totals.first_batch = totals.first_batch or list(indices)
        out, sync, grad_norm = _micro_step(s, batch)
        s.micro += 1
        n_tok = int(batch["attention_mask"].sum())
        totals.tokens += n_tok
        s.tokens += n_tok
        window.add(float(out.loss.detach()), out.correct, out.counted, n_tok)
        totals.seconds += time.perf_counter() - t0
        totals.cpu_seconds += time.process_time() - c0
        if not sync:
            continue
        s.step += 1
        bar.update(1)
        s.curve.maybe_measure(s, totals.seconds, totals.cpu_seconds)
        if s.step % max(1, t.log_every) == 0 or s.step == total:
            totals.last_loss = _log_window(s, window, grad_norm, bar)
        final = s.step == total
        do_save = final or (t.save_every > 0 and s.step % t.save_every == 0)
        if final or do_save or (t.eval_every > 0 and s.step % t.eval_every == 0):
            totals.last_eval = s.evaluate_and_log(s.step)
            if totals.last_eval:
                s.history.append({k: v for k, v in totals.last_eval.items() if k != "val_topk_accuracy"})
        if do_save:
            s.save(s.step, totals.last_eval)
            last_saved = s.step
    bar.close()
    if last_saved != s.step:  # resumed at the very end: nothing left to train, the final checkpoint exists
        totals.last_eval = totals.last_eval or s.evaluate_and_log(s.step)
    return totals


def _finish(s: _Session, totals: _Totals) -> dict:
    """The run's summary (written to checkpoints/train-summary.json by rank 0, returned by every rank)."""
    acc, root, t, ev = s.acc, s.recipe.paths.checkpoints, s.recipe.train, totals.last_eval
    summary = {
        "status": "done", "family": s.recipe.speculator.family, "mode": s.setup.mode, "steps": s.step,
        "total_steps": s.plan.total_steps, "processes": acc.num_processes,
        "resumed_from_step": int(s.state.get("step", 0)) if s.resume_dir is not None else None,
        "distributed": str(acc.distributed_type).split(".")[-1], "precision": acc.mixed_precision,
        "tokens_trained_this_run_per_process": totals.tokens,
        "tokens_per_s_per_process": round(totals.tokens / totals.seconds, 1) if totals.seconds > 0 else None,
        "tokens_per_cpu_second": round(totals.tokens / totals.cpu_seconds, 1) if totals.cpu_seconds > 0 else None,
        "peak_memory_mb": peak_memory_mb(acc.device),
        "final_loss": round(totals.last_loss, 5) if math.isfinite(totals.last_loss) else None,
        "val_top1_accuracy": ev.get("val_top1_accuracy"),
        "val_per_position_acceptance": ev.get("per_position_acceptance"),
        "val_simulated_tau": ev.get("simulated_tau"),
        "best_checkpoint": str(root / s.best["checkpoint"]) if s.best else None,
        "best_simulated_tau": s.best.get("simulated_tau") if s.best else None,
        "latest_checkpoint": str(root / step_name(s.step)),
        "train_seconds": round(totals.seconds, 1), "signature": train_signature(s.recipe), "complete": True,
    }
    summary.update(s.curve.finish(totals.seconds, s.main), validation_seconds=round(s.validation_seconds, 2))
    mem = acc.gather(torch.tensor([summary["peak_memory_mb"]], dtype=torch.float64, device=acc.device)).cpu()
    summary["peak_memory_mb_max_process"] = float(mem.max())
    firsts = torch.full((t.batch_size,), -1, dtype=torch.long)
    firsts[:len(totals.first_batch)] = torch.tensor(totals.first_batch, dtype=torch.long)
    gathered = acc.gather(firsts.to(acc.device)).cpu().view(acc.num_processes, t.batch_size)
    summary["first_batch_per_process"] = [[i for i in row if i >= 0] for row in gathered.tolist()]
    s.tracker.log({k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
                  s.step, kind="summary")
    s.tracker.close()
    if s.main:
        write_text_atomic(root / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    if acc.num_processes > 1:  # every rank returns rank 0's summary (each node's launcher reports it)
        summary = broadcast_object_list([summary if s.main else None], from_process=0)[0]
    acc.wait_for_everyone()
    return summary
