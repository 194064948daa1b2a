#!/usr/bin/env python
"""Both capture backends on the same rows, one after the other in one run: tokens/s of each (forward only, and wall
including the model load / vLLM engine start), their ratio, and how far vLLM's shards are from HF's per tap
(data/feature_compare.py).

usage: scripts/capture_backends.py RECIPE [section.key=value ...]
  Prepares (and regenerates, when the recipe says so) the recipe's data once, then captures it into
  <run_dir>/backends/hf and <run_dir>/backends/vllm (capture.backend=hf / vllm), and writes
  <run_dir>/backends/report.json + report.md. The CPU is named in the report; run nothing else meanwhile.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

from speculators.core.machine import device_name
from speculators.core.recipes import load_recipe
from speculators.data import capture, prepare, regenerate
from speculators.data.feature_compare import compare_features


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    recipe = load_recipe(argv[0], argv[1:])
    prepare.run(recipe)
    if recipe.data.regenerate.enabled:
        regenerate.run(recipe)
    root = Path(recipe.run_dir) / "backends"
    rows = {}
    for backend in ("hf", "vllm"):
        run_dir = root / backend
        data = recipe.training_data_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(run_dir / data.name, ignore_errors=True)
        shutil.copytree(data, run_dir / data.name)
        variant = dataclasses.replace(recipe, run_dir=str(run_dir),
                                      capture=dataclasses.replace(recipe.capture, backend=backend))
        if recipe.data.regenerate.enabled:  # the prepared rows the regenerated ones came from, for the data check
            shutil.rmtree(run_dir / "prepared", ignore_errors=True)
            shutil.copytree(recipe.paths.prepared, run_dir / "prepared")
        capture.run(variant, force=True)
        m = json.loads((run_dir / "features" / "manifest.json").read_text())
        tokens, t = m["counts"]["tokens"], m["throughput"]
        rows[backend] = {"tokens": tokens, "forward_tokens_per_s": t["forward_tokens_per_s"],
                         "wall_seconds": t["wall_seconds"], "wall_tokens_per_s": round(tokens / t["wall_seconds"], 1)}
    equivalence = compare_features(root / "hf" / "features", root / "vllm" / "features")
    report = {"cpu": device_name("cpu"), "target": recipe.target.name_or_path, "backends": rows,
              "vllm_over_hf_forward": round(rows["vllm"]["forward_tokens_per_s"] / rows["hf"]["forward_tokens_per_s"], 3),
              "vllm_over_hf_wall": round(rows["vllm"]["wall_tokens_per_s"] / rows["hf"]["wall_tokens_per_s"], 3),
              "equivalence": equivalence}
    lines = [f"# capture backends: {recipe.target.name_or_path} ({report['cpu']})", "",
             "| backend | tokens | forward tok/s | wall s | wall tok/s |", "|---|---|---|---|---|"]
    lines += [f"| {b} | {r['tokens']} | {r['forward_tokens_per_s']} | {r['wall_seconds']} | {r['wall_tokens_per_s']} |"
              for b, r in rows.items()]
    lines += ["", f"vLLM / HF: {report['vllm_over_hf_forward']}x forward, {report['vllm_over_hf_wall']}x wall", "",
              "| tap (layer) | max rel. error | mean rel. error |", "|---|---|---|"]
    lines += [f"| {t['layer']} | {t['max_relative_error']} | {t['mean_relative_error']} |" for t in equivalence["taps"]]
    for key in ("last_hidden", "teacher"):
        if key in equivalence:
            lines.append(f"\n{key}: {json.dumps(equivalence[key])}")
    lines.append(f"\nstorage quantisation (relative rmse): {json.dumps(equivalence['storage_rmse'][0])}")
    (root / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (root / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
