"""The record and the Markdown of `speculators profile` (profile.json / profile.md).

`build_report` turns the measured costs (seconds) and the oracle's predictions into one JSON-able record (times in
milliseconds); `format_report` renders it for people; `write_report` writes both files atomically.
This module formats numbers; it measures and predicts nothing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from speculators.oracle.cost_model import Acceptance, Costs
from speculators.oracle.costs import clock_name
from speculators.serving.bench import write_json_and_markdown


def _ms(x: float) -> float:
    return round(1000 * x, 4)


def _to_ms(d: dict) -> dict:
    return {str(k): _ms(v) for k, v in sorted(d.items())}


def _shape(loaded: Any) -> dict:
    cfg = loaded.config
    fields = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size")
    out = {f: getattr(cfg, f, None) for f in fields}
    out["parameters"] = sum(p.numel() for p in loaded.model.parameters())
    return out


def _drafters(drafters: dict[str, tuple[Any, str]], costs: Costs, trees: dict) -> dict:
    out = {}
    for family, (_, precision) in drafters.items():
        c = costs.drafters[family]
        out[family] = {"precision": precision,
                       "trees": {k: dataclasses.asdict(t) for k, t in trees[family].items()},
                       "propose_ms": {k: {str(d): _ms(s) for d, (s, _) in sorted(v.items())}
                                      for k, v in c.propose.items()},
                       "draft_nodes": {k: {str(d): n for d, (_, n) in sorted(v.items())} for k, v in c.propose.items()},
                       "absorb_ms_by_tokens": _to_ms(c.absorb)}
    return out


def _schedule(rows: list[dict]) -> dict:
    vllm = [[r["start_bs"], r["end_bs"], r["k"]] for r in rows]
    k = max((r["k"] for r in rows), default=0)
    config: dict[str, Any] = {"num_speculative_tokens": k}
    if len({r["k"] for r in rows}) > 1:
        config["num_speculative_tokens_per_batch_size"] = vllm
    return {"rows": rows, "vllm": vllm, "speculative_config": config}


def build_report(*, loaded: Any, name: str, device: str, context_len: int, drafters: dict[str, tuple[Any, str]],
                 costs: Costs, extras: dict, acceptance: Acceptance | None, predictions: dict[str, list[dict]],
                 schedules: dict[str, list[dict]], check: dict | None, budget_s: float) -> dict:
    shape, sliced = _shape(loaded), extras.get("slice")
    if sliced:  # the shape's own layer count and parameters, not the slice's
        shape.update(num_hidden_layers=sliced["num_layers"], parameters=sliced["parameters"])
    return {
        "target": name, "shape": shape, "slice": sliced, "device": device,
        "dtype": str(loaded.dtype).replace("torch.", ""), "torch": torch.__version__, "context_len": context_len,
        "clock": clock_name(loaded.device), "threads": torch.get_num_threads(),
        "budget_s": budget_s, "measure_seconds": extras["seconds"], "skipped": extras["skipped"],
        "target_forward_ms": {str(b): _to_ms(v) for b, v in sorted(costs.forward.items())},
        "prefill_ms": {k: _to_ms(v) for k, v in extras["prefill"].items()},
        "drafters": _drafters(drafters, costs, extras["trees"]),
        "overhead_ms": {"plain": _to_ms(costs.overhead_plain),
                        "speculative": {str(b): _to_ms(v) for b, v in sorted(costs.overhead_spec.items())}},
        "acceptance": None if acceptance is None else dataclasses.asdict(acceptance),
        "predictions": predictions,
        "schedule": {f: _schedule(rows) for f, rows in schedules.items()},
        "check": check,
    }


def _forward_md(report: dict) -> list[str]:
    fwd = report["target_forward_ms"]
    ns = sorted({int(n) for row in fwd.values() for n in row})
    lines = [f"## Target forward (ms): B sequences x n new tokens on a {report['context_len']}-token KV cache", "",
             "| B \\ n | " + " | ".join(map(str, ns)) + " |", "|---|" + "---:|" * len(ns)]
    for b, row in fwd.items():
        lines.append(f"| {b} | " + " | ".join(f"{row[str(n)]:.3f}" if str(n) in row else "–" for n in ns) + " |")
    return [*lines, ""]


def _drafters_md(report: dict) -> list[str]:
    lines = ["## Drafters (ms to propose at depth d; draft nodes in brackets)", ""]
    for family, d in report["drafters"].items():
        lines.append(f"- **{family}** ({d['precision']}); absorbing n committed tokens: "
                     + ", ".join(f"{n}: {ms:.3f}" for n, ms in d["absorb_ms_by_tokens"].items()) + " ms")
        for kind, by_depth in d["propose_ms"].items():
            lines.append(f"  - {_tree_text(d['trees'][kind])}: " + ", ".join(
                f"d={dd}: {ms:.3f} [{d['draft_nodes'][kind][dd]:g}]" for dd, ms in by_depth.items()))
    ov = report["overhead_ms"]
    lines += ["", "Runtime overhead per step (ms, all B requests: verification, commits, the loop): plain "
              + ", ".join(f"B={b}: {ms:.3f}" for b, ms in ov["plain"].items()) + "; speculative "
              + "; ".join(f"B={b}: " + ", ".join(f"{n} nodes {ms:.3f}" for n, ms in row.items())
                          for b, row in ov["speculative"].items()), ""]
    return lines


def _tree_text(t: dict) -> str:
    return "chain" if t.get("kind") == "chain" else f"{t.get('kind')} top-{t.get('topk')}, budget {t.get('budget')}"


def _predictions_md(report: dict) -> list[str]:
    acc = report["acceptance"]
    if acc is None:
        return ["No acceptance given (--acceptance): costs only, no prediction.", ""]
    lines = [f"## Predicted speedup (acceptance from {acc['source']}, T = {acc['temperature']})", "",
             "chain a_k: " + ", ".join(f"{a:.3f}" for a in acc["chain"])
             + ("; live tree a_k: " + ", ".join(f"{a:.3f}" for a in acc["tree"]) if acc["tree"] else "")
             + (f" (measured by the evaluation on its runtime's tree: {_tree_text(acc['tree_settings'])}; the tree "
                "timed here may differ: wider trees accept more than these a_k say)" if acc["tree_settings"] else ""), ""]
    for family, rows in report["predictions"].items():
        depths = sorted({c["depth"] for r in rows for c in r["candidates"] if c["kind"] == "chain"})
        lines += [f"### {family}", "", "| batch | plain tok/s | best | tau | tok/s | × plain | "
                  + " | ".join(f"chain {d}" for d in depths) + " |", "|---|---:|---|---:|---:|---:|"
                  + "---:|" * len(depths)]
        for r in rows:
            b = r["best"]
            chains = {c["depth"]: c["speedup"] for c in r["candidates"] if c["kind"] == "chain"}
            best = "plain" if b["kind"] == "plain" else f"{b['kind']} {b['depth']} ({b['nodes']:g} nodes)"
            lines.append(f"| {r['batch']} | {r['plain_tokens_per_s']:.1f} | {best} | {b['tau']:.2f} | "
                         f"{b['tokens_per_s']:.1f} | **{b['speedup']:.2f}** | "
                         + " | ".join(f"{chains[d]:.2f}" if d in chains else "–" for d in depths) + " |")
        sched = report["schedule"][family]
        lines += ["", f"vLLM schedule (chains; [start_bs, end_bs, k]): `{json.dumps(sched['vllm'])}`; "
                  f"`--speculative-config` fields: `{json.dumps(sched['speculative_config'])}`", ""]
    return lines


def _check_md(check: dict | None) -> list[str]:
    if not check:
        return []
    lines = [f"## Check: predicted vs measured speedup ({check['rows_per_cohort']} rows per cohort, T = 0)", "",
             f"Measured with `{check['bench_command']}` (the same code, in this process).", "",
             f"Measured × plain: generated tokens per {check['clock']} (the clock of the costs), wall clock beside "
             "it.", "",
             "| chain K | cohort | rows | tokens | live tau | predicted × plain (evaluate a_k) | "
             "predicted (live a_k) | measured × plain | error | measured, wall clock |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in check["table"]:
        name = f"**{r['cohort']}**" if r["cohort"] == "all" else r["cohort"]
        lines.append(f"| {r['depth']} | {name} | {r['rows']} | {r['tokens']} | {r['live_tau']:.2f} | "
                     f"{r['predicted']:.3f} | {r['predicted_live_acceptance']:.3f} | **{r['measured']:.3f}** | "
                     f"{100 * r['error']:+.1f}% | {r['measured_wall']:.3f} |")
    return [*lines, ""]


def format_report(report: dict) -> str:
    s = report["shape"]
    lines = [f"# speculators profile — {report['target']} on {report['device']} ({report['dtype']})", "",
             f"- shape: {s['model_type']}, hidden {s['hidden_size']} x {s['num_hidden_layers']} layers, heads "
             f"{s['num_attention_heads']} / {s['num_key_value_heads']}, vocab {s['vocab_size']}, "
             f"{s['parameters'] / 1e6:.1f}M parameters; torch {report['torch']}",
             f"- measured in {report['measure_seconds']} s (budget {report['budget_s']} s); every time is the "
             f"minimum over repeats ({report['clock']}; whole steps: their mean), {report['threads']} torch threads",
             *([f"- skipped: {'; '.join(report['skipped'])}"] if report["skipped"] else []),
             *([f"- a slice: the forward and prefill of its first {sl['layers_timed'][0]} and {sl['layers_timed'][1]} "
                f"decoder layers timed (embedding and head at full size) and scaled to {sl['num_layers']}: "
                f"{sl['rule']}; drafters and runtime steps timed on the {sl['layers_timed'][1]}-layer slice"]
               if (sl := report.get("slice")) else []), ""]
    lines += _forward_md(report) + _drafters_md(report) + _predictions_md(report) + _check_md(report["check"])
    return "\n".join(lines)


def write_report(report: dict, out: Path | None) -> str:
    """The Markdown; with `out`, profile.json and profile.md are written there (each atomically)."""
    text = format_report(report)
    if out is not None:
        write_json_and_markdown(out, "profile", report, text)
    return text
