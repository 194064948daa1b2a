"""How much of what the target says a draft vocabulary of each size covers: the measurement that picks
`speculator.draft_vocab_size`.

Reads a capture's training-token counts (`<run>/features/token_freq.safetensors`, the counts the draft vocabulary is
built from) and the target's own continuations on the held-out workloads (`<run>/eval/continuations.json`, written
by `speculators evaluate`), builds the draft vocabulary of each size the way capture does, and prints, per sampling
temperature, the share of the target's held-out tokens inside it. A token outside the draft vocabulary can never be
drafted, so the share bounds per-position acceptance from above. Computes nothing about acceptance itself (that is
`speculators evaluate`).

    python scripts/draft_vocab_coverage.py runs/smollm2-eagle3 --sizes 4096,8192,16384,32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from speculators.core.errors import SpeculatorsError
from speculators.data import vocab
from speculators.evaluate.teacher import continuations_by_temperature


def coverage_table(run_dir: Path, sizes: list[int]) -> str:
    """A Markdown table: one row per sampling temperature, one column per draft vocabulary size."""
    freq, forced = vocab.load_token_freq(run_dir / "features")  # one error line when capture has not run
    by_temperature = continuations_by_temperature(run_dir / "eval" / "continuations.json")
    if not by_temperature:
        raise SpeculatorsError(f"{run_dir}/eval/continuations.json: no continuations of the target; run `speculators "
                               "evaluate` first")
    vocabs = {size: vocab.build_vocab(freq, size, forced)[1] for size in sizes}  # size -> t2d [V] bool
    lines = ["| target's held-out tokens | tokens | " + " | ".join(f"{s:,}" for s in sizes) + " |",
             "|---|---:|" + "---:|" * len(sizes)]
    for temperature, tokens in sorted(by_temperature.items()):
        counts = torch.bincount(torch.tensor(tokens), minlength=freq.numel())  # [V]
        shares = " | ".join(f"{vocab.coverage(vocabs[s], counts):.3f}" for s in sizes)
        lines.append(f"| T = {temperature} | {len(tokens):,} | {shares} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--sizes", default="4096,8192,16384,32768", help="comma-separated draft vocabulary sizes")
    args = parser.parse_args()
    try:
        print(coverage_table(args.run_dir, [int(s) for s in args.sizes.split(",")]))
    except (SpeculatorsError, ValueError) as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
