#!/usr/bin/env python
"""Where `make test`'s time goes: the seconds of every test in the JUnit files `make test` writes (.test-times.xml,
.test-times-vllm.xml), summed by test file, slowest first, with each file's share of its suite.

usage: python scripts/test_times.py [FILE.xml ...] [--top N]
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def by_file(path: Path) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown together) of one JUnit report."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "?").split(".")
        module = "/".join(p for p in name if not p[:1].isupper()) + ".py"  # drop a test class name
        totals[module] += float(case.get("time", 0.0))
    return dict(totals)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="*", default=[".test-times.xml", ".test-times-vllm.xml"])
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    for report in map(Path, args.reports):
        if not report.is_file():
            print(f"{report}: not found (run make test first)", file=sys.stderr)
            continue
        totals = by_file(report)
        whole = sum(totals.values())
        print(f"{report}: {whole:,.0f} s of tests in {len(totals)} files")
        for module, seconds in sorted(totals.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {seconds:8.1f} s  {100 * seconds / whole:5.1f}%  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
