"""Evaluation reports: JSON (the record), Markdown (for people) and PNG plots (matplotlib, Agg backend).

Per checkpoint, `write_checkpoint_report(dir, report)` writes into `eval/<step>/`:
  report.json         the full record (format "speculators.eval/v1"; see `evaluate.py` for the fields)
  report.md           per temperature: a table per cohort with a_1..a_D, simulated tau (every position and at
                      cycle starts), the n-gram baseline's tau and, when measured, the live runtime's tau and
                      a_k; then predicted vs live (vs vLLM, when filled in) for the chain, the runtime's default
                      tree and the n-gram chain, per cohort and position, with what differs and why; for a
                      target the bundled runtime cannot run, one line saying so and why instead of the live parts
  per_position.png    per-position acceptance a_k per cohort (speculator solid, n-gram dashed), one panel per T
  tau.png             simulated tau per cohort, speculator vs n-gram (and live when measured), one panel per T
`write_overview(eval_dir, selection, reports)` writes `eval/report.md` (checkpoint table + the chosen one, the
runtime's refusal line when there is one, and the chosen one side by side with `evaluate.baselines`) and
`eval/selection.png` (mean tau per checkpoint, with the recorded loss for reference).

This module formats numbers; it computes none (they come from `speculators.core.metrics` via `alpha.py`).
"""

from __future__ import annotations

from pathlib import Path

from speculators.core.atomic import write_json_atomic, write_text_atomic
from speculators.core.metrics import temperature_key


def _cohort_entry(summary: dict, cohort: str) -> dict | None:
    """A summary's pooled entry for "overall", else that cohort's entry (None where it has none)."""
    return summary.get("overall") if cohort == "overall" else (summary.get("cohorts") or {}).get(cohort)


def _fmt(x: object, nd: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _temps(report: dict) -> list[str]:
    return sorted(report.get("temperatures", {}), key=float)


def runtime_unavailable_line(reason: str | None) -> list[str]:
    """The one line a report carries when the bundled runtime cannot run the target (empty list otherwise)."""
    if not reason:
        return []
    return [f"- no live or predicted-vs-live columns, and the target's continuations were written by HF `generate`: "
            f"the bundled runtime cannot run this target ({reason})"]


def render_markdown(report: dict) -> str:
    lines = [f"# Acceptance report — {report['checkpoint']} ({report.get('family', '?')})", ""]
    tgt = report.get("target") or {}
    lines += [f"- target: `{tgt.get('name_or_path')}` @ `{tgt.get('revision')}`",
              f"- draft revision: `{report.get('draft_revision')}`",
              f"- workloads: {', '.join(report.get('workloads', []))} — {report.get('rows')} rows, "
              f"cohorts: {', '.join(report.get('cohorts', []))}",
              f"- teacher-forced chain depth {report.get('speculator_depth')} for both drafters (n-gram to depth "
              f"{report.get('depth')}: see report.json `ngram_full_depth`)",
              "- a_k = P(depth-k draft accepted | depths < k accepted); simulated tau = 1 + sum_k prod_{j<=k} a_j "
              "(committed tokens per target call, bonus included)",
              "- at T > 0: tau of the sampled chain verified token by token (min(1, p/q) per depth) and, as `block "
              "tau`, verified jointly by block verification (Sun et al. 2024; vLLM `rejection_sample_method: "
              "\"block\"`; never lower), both from the same teacher-forced laws (`speculators.core.metrics`)",
              *runtime_unavailable_line(report.get("runtime_unavailable")), ""]
    live = report.get("live") or {}
    for t in _temps(report):
        entry = report["temperatures"][t]
        spec, ngram, block = entry["speculator"], entry["ngram"], entry.get("speculator_block")
        depth = len(next(iter(spec["cohorts"].values()))["per_position_acceptance"]) if spec["cohorts"] else 0
        lv = live.get(t) or {}
        cyc = spec.get("cycle_starts") or {}
        head = ["cohort", "rows", "positions", *[f"a_{k}" for k in range(1, depth + 1)], "tau",
                *(["block tau"] if block else []), "n-gram tau"]
        ngram_cyc = ngram.get("cycle_starts") or {}
        if cyc.get("cohorts"):
            head += ["tau at cycle starts"]
        if ngram_cyc:
            head += ["n-gram tau at cycle starts"]
        if lv:
            head += ["live tau (tree)", "live a_k", "live n-gram tau"]
        lines += [f"## T = {t}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        cohorts = [*spec["cohorts"], "overall"]
        for c in cohorts:
            s, g = _cohort_entry(spec, c), _cohort_entry(ngram, c)
            if s is None:
                continue
            b = _cohort_entry(block, c) if block else None
            row = [c if c != "overall" else "**overall (pooled)**", str(s["rows"]), str(s["positions"]),
                   *[_fmt(a) for a in s["per_position_acceptance"]], f"**{_fmt(s['simulated_tau'])}**",
                   *([_fmt(b["simulated_tau"] if b else None)] if block else []),
                   _fmt(g["simulated_tau"] if g else None)]
            if cyc.get("cohorts"):
                row.append(_fmt((_cohort_entry(cyc, c) or {}).get("tau")))
            if ngram_cyc:
                row.append(_fmt((_cohort_entry(ngram_cyc, c) or {}).get("tau")))
            if lv:
                ls = (lv.get("speculator") or {}).get(c) or {}
                ln = (lv.get("ngram_live") or lv.get("ngram") or {}).get(c) or {}
                row += [_fmt(ls.get("tau")), ", ".join(_fmt(a, 2) for a in ls.get("per_position_acceptance", []))
                        or "–", _fmt(ln.get("tau"))]
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", f"Mean over cohorts: speculator tau **{_fmt(spec['mean_tau'])}** (every position)"
                      + (f", block verification {_fmt(block['mean_tau'])}" if block else "")
                      + f", {_fmt((spec.get('cycle_starts') or {}).get('mean_tau'))} at cycle starts; n-gram tau "
                      f"{_fmt(ngram['mean_tau'])}"
                      + (f", {_fmt(ngram_cyc.get('mean_tau'))} at cycle starts" if ngram_cyc else "") + ".", ""]
        if spec.get("ceilings"):
            ceil = ", ".join(f"{name.replace('_', ' ')} {_fmt(c['mean_tau'])}" for name, c in spec["ceilings"].items())
            argmax = (spec.get("cycle_starts_argmax_drafts") or {}).get("mean_tau")
            lines += [f"Sampling diagnostics: chain tau of a draft equal to what it is taught — {ceil} (a top-k "
                      f"teacher's optimum is the renormalised top-k; no draft over the reduced vocabulary exceeds "
                      f"the target's mass on it); at cycle starts with argmax drafts instead of sampled ones: "
                      f"{_fmt(argmax)}." + _calibration(spec), ""]
        lines += _agreement_lines(lv, t)
    lines += ["`tau` averages the chain over every position; `tau at cycle starts` walks the cycles a server runs "
              "(`evaluate/replay.py`): the number serving measures.", ""]
    if live:
        lines += [f"Live: the bundled runtime on {report.get('live_rows_per_cohort')} rows per cohort "
                  f"(`speculators.serving.Engine`, fixed trees, adaptive depth off); tau = committed tokens / target "
                  "calls.", ""]
    if report.get("loss") is not None:
        lines += [f"Recorded training loss (for reference, not used for selection): {_fmt(report['loss'], 4)}", ""]
    return "\n".join(lines)


def _calibration(spec: dict) -> str:
    """The draft-calibration sentence: every-position tau with the draft's logits divided by s (s = 1: as trained)."""
    scaled = spec.get("draft_scales")
    if not scaled:
        return ""
    taus = {**{float(s): v for s, v in scaled.items()}, 1.0: spec["mean_tau"]}
    best = max(taus, key=lambda s: taus[s])
    cells = ", ".join(f"s={s:g} {_fmt(taus[s])}" for s in sorted(taus))
    verdict = ("the draft is calibrated (s = 1 is best)" if best == 1.0 else
               f"s={best:g} would gain {100 * (taus[best] / taus[1.0] - 1):+.1f}%")
    return f" Draft calibration (sampling from softmax(logits / s), lossless for any s): {cells}; {verdict}."


def _gap(v: dict) -> str:
    lo, hi = v.get("tau_gap_interval_paired_rows") or (None, None)
    band = f" [{100 * lo:+.1f}, {100 * hi:+.1f}]" if lo is not None else ""
    return f"{100 * v['tau_gap']:+.1f}%{band}"


def _agreement_lines(lv: dict, t: str) -> list[str]:
    """Predicted vs live vs vLLM for each compared drafting shape at one temperature."""
    lines: list[str] = []
    for name, title in (("chain", "chain"), ("tree", "runtime default tree"), ("ngram", "n-gram chain")):
        block = lv.get(name)
        if not isinstance(block, dict) or "cohorts" not in block:
            continue
        tree = block.get("tree") or {}
        shape = f"depth {tree.get('depth')}" + (f", top-{tree.get('topk')}, {tree.get('budget')} nodes"
                                                if tree.get("kind") != "chain" else "")
        extra = f", drafts: {block['draft']}" if block.get("draft") else ""
        if float(t) > 0 and tree.get("kind") == "chain" and tree.get("verify") == "token":
            extra += ", verified token by token"
        lines += [f"### T = {t}: predicted vs live — {title} ({shape}{extra}; live drafting: "
                  f"{block.get('live_precision') or '?'})", "",
                  "| cohort | predicted tau | live tau [95% binomial] | gap [95% paired rows] | "
                  "a_k predicted | a_k live | agree (binomial / paired) | positions that differ |",
                  "|" + "---|" * 8]
        whys = []
        for c, v in block["cohorts"].items():
            p, lvv = v["predicted"], v["live"]
            lo, hi = lvv["tau_interval"]
            lines.append(" | ".join([
                f"| {c}", _fmt(p["tau"]), f"{_fmt(lvv['tau'])} [{_fmt(lo)}, {_fmt(hi)}]",
                _gap(v), " ".join(_fmt(a, 2) for a in p["per_position_acceptance"]),
                " ".join(_fmt(a, 2) for a in lvv["per_position_acceptance"]),
                ("yes" if v["agree"] else "**no**") + " / " + ("yes" if v.get("agree_paired_rows", True) else "**no**"),
                ", ".join(map(str, v["differing_positions"])) or "–"]) + " |")
            if v.get("why"):
                whys.append(f"{c}: {v['why']}")
        lines += [""] + [f"- {w}" for w in whys] + ([""] if whys else [])
    return lines


def plot_per_position(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = _temps(report)
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        entry = report["temperatures"][t]
        for i, (c, s) in enumerate(entry["speculator"]["cohorts"].items()):
            color = f"C{i % 10}"
            a = s["per_position_acceptance"]
            ax.plot(range(1, len(a) + 1), a, marker="o", color=color, label=c)
            g = entry["ngram"]["cohorts"].get(c)
            if g:
                ga = g["per_position_acceptance"]
                ax.plot(range(1, len(ga) + 1), ga, linestyle="--", color=color, alpha=0.6)
        depth = max((len(s["per_position_acceptance"]) for s in entry["speculator"]["cohorts"].values()), default=1)
        ax.set_xticks(range(1, depth + 1))
        ax.set_title(f"{report['checkpoint']} — T={t} (dashed: n-gram)")
        ax.set_xlabel("draft depth k")
        ax.set_ylabel("a_k (conditional acceptance)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tau(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = _temps(report)
    live = report.get("live") or {}
    fig, axes = plt.subplots(1, len(temps), figsize=(7 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        entry = report["temperatures"][t]
        cohorts = list(entry["speculator"]["cohorts"])
        series = [("speculator (simulated)", [entry["speculator"]["cohorts"][c]["simulated_tau"] for c in cohorts]),
                  ("n-gram (simulated)", [(entry["ngram"]["cohorts"].get(c) or {}).get("simulated_tau", 0.0)
                                          for c in cohorts])]
        lv = live.get(t) or {}
        if lv:
            series.append(("speculator (live)", [((lv.get("speculator") or {}).get(c) or {}).get("tau", 0.0)
                                                 for c in cohorts]))
            series.append(("n-gram (live)", [((lv.get("ngram_live") or {}).get(c) or {}).get("tau", 0.0)
                                             for c in cohorts]))
        width = 0.8 / len(series)
        for j, (label, vals) in enumerate(series):
            ax.bar([i + j * width for i in range(len(cohorts))], vals, width=width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cohorts))])
        ax.set_xticklabels(cohorts, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("tau (tokens per target call)")
        ax.set_title(f"{report['checkpoint']} — T={t}")
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_checkpoint_report(out_dir: Path, report: dict) -> None:
    """report.json + report.md + per_position.png + tau.png into `out_dir` (an already-created directory)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_per_position(report, out_dir / "per_position.png")
    plot_tau(report, out_dir / "tau.png")
    write_text_atomic(out_dir / "report.md", render_markdown(report) + "\n")
    write_json_atomic(out_dir / "report.json", report)


def render_overview(selection: dict, reports: dict[str, dict]) -> str:
    t = selection["temperature"]
    refusal = runtime_unavailable_line(selection.get("runtime_unavailable"))
    lines = ["# Evaluation overview", "",
             f"Selection metric: {selection['metric']}. Best checkpoint: **{selection['best']}** "
             "(written to `checkpoints/best`).", "", *refusal, *([""] if refusal else []),
             "| checkpoint | mean tau | recorded loss (not used) |", "|---|---|---|"]
    for row in selection["checkpoints"]:
        mark = " ← best" if row["checkpoint"] == selection["best"] else ""
        lines.append(f"| {row['checkpoint']}{mark} | {_fmt(row['mean_tau'])} | {_fmt(row['loss'], 4)} |")
    lines += ["", f"Per-cohort tables of the best checkpoint: `eval/{selection['best']}/report.md`.", ""]
    summary = selection["summary"].get(temperature_key(t))
    if summary:
        cyc, ncyc = summary.get("cycle_tau") or {}, summary.get("ngram_cycle_tau") or {}
        lines += [f"## Best checkpoint at T = {t}", "",
                  "Every position / a server's cycle starts (the positions serving drafts at), both drafters at the "
                  "speculator's depth.", "",
                  "| cohort | speculator tau | n-gram tau | speculator tau at cycle starts | n-gram tau at cycle starts |",
                  "|---|---|---|---|---|"]
        for c, v in summary["tau"].items():
            lines.append(f"| {c} | {_fmt(v)} | {_fmt(summary['ngram_tau'].get(c))} | {_fmt(cyc.get(c))} | "
                         f"{_fmt(ncyc.get(c))} |")
        lines.append(f"| **mean** | **{_fmt(summary['mean_tau'])}** | {_fmt(summary['ngram_mean_tau'])} | "
                     f"**{_fmt(summary.get('cycle_mean_tau'))}** | {_fmt(summary.get('ngram_cycle_mean_tau'))} |")
    lines += _side_by_side(selection)
    return "\n".join(lines)


def _side_by_side(selection: dict) -> list[str]:
    """The best checkpoint next to `evaluate.baselines` (same rows, same continuations), per temperature and cohort:
    simulated tau at every position / at a server's cycle starts, each at its own depth."""
    baselines = selection.get("baselines") or []
    if not baselines:
        return []
    present = [b for b in baselines if not b.get("missing")]
    lines = ["", "## Side by side with the baselines (same rows, same target continuations)", "",
             "tau at every position / at cycle starts, each speculator at its own depth (min(evaluate.depth, K)).", ""]
    lines += [f"- baseline `{b['label']}`: not evaluated, the path does not exist (yet); run its recipe, then evaluate "
              f"again" for b in baselines if b.get("missing")]
    if not present:
        return lines
    head = ["cohort", f"{selection['best']} (this run)", *(f"`{b['label']}` ({b['family']}, depth "
                                                           f"{b['speculator_depth']})" for b in present), "n-gram"]
    for t in sorted(selection.get("summary", {}), key=float):
        mine = selection["summary"][t]
        theirs = [b["temperatures"].get(t) or {} for b in present]
        lines += ["", f"### T = {t}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in mine["tau"]:
            cells = [f"{_fmt(mine['tau'][c])} / {_fmt(mine['cycle_tau'].get(c))}",
                     *(f"{_fmt(b.get('tau', {}).get(c))} / {_fmt(b.get('cycle_tau', {}).get(c))}" for b in theirs),
                     f"{_fmt(mine['ngram_tau'].get(c))} / {_fmt((mine.get('ngram_cycle_tau') or {}).get(c))}"]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        cells = [f"{_fmt(mine['mean_tau'])} / {_fmt(mine['cycle_mean_tau'])}",
                 *(f"{_fmt(b.get('mean_tau'))} / {_fmt(b.get('cycle_mean_tau'))}" for b in theirs),
                 f"{_fmt(mine['ngram_mean_tau'])} / {_fmt(mine.get('ngram_cycle_mean_tau'))}"]
        lines.append("| **mean** | " + " | ".join(f"**{x}**" for x in cells) + " |")
    return lines


def plot_selection(selection: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = selection["checkpoints"]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["mean_tau"] for r in rows], marker="o", color="C0", label="mean simulated tau")
    ax.set_xlabel("training step")
    ax.set_ylabel(f"mean tau (T={selection['temperature']})", color="C0")
    best = next(r for r in rows if r["checkpoint"] == selection["best"])
    ax.scatter([best["step"]], [best["mean_tau"]], s=120, facecolors="none", edgecolors="red", label="best")
    losses = [(r["step"], r["loss"]) for r in rows if r["loss"] is not None]
    if losses:
        ax2 = ax.twinx()
        ax2.plot([s for s, _ in losses], [v for _, v in losses], marker="x", color="C1", linestyle=":")
        ax2.set_ylabel("recorded loss (reference)", color="C1")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


VLLM_SECTION_HEADING = "## vLLM as the consumer (`speculators vllm-check`)"


def with_vllm_section(text: str, eval_dir: Path) -> str:
    """An eval/report.md text with eval/vllm/report.md (written by the vllm-check stage) as its last section,
    replacing an older copy of that section."""
    head = text.split(VLLM_SECTION_HEADING)[0].rstrip()
    try:
        section = (eval_dir / "vllm" / "report.md").read_text()
    except OSError:
        return head + "\n"
    return head + "\n\n" + section.rstrip() + "\n"


def write_overview(eval_dir: Path, selection: dict, reports: dict[str, dict]) -> None:
    plot_selection(selection, eval_dir / "selection.png")
    write_text_atomic(eval_dir / "report.md", with_vllm_section(render_overview(selection, reports), eval_dir))
