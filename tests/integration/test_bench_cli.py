"""`speculators bench` on the house target prints its table and writes JSON + Markdown, with every cohort of
methods (plain, n-gram, a speculator, HF generate, HF assisted) at T=0 and T=1; at T=0 every runtime method
reproduces plain decoding token for token."""

from __future__ import annotations

import json

import pytest

from tests.integration.cli_helpers import cli
from tests.unit.serving.runtime_helpers import make_speculator_dir

pytestmark = pytest.mark.integration


def test_bench_table_and_report(house_target, tmp_path) -> None:
    spec = make_speculator_dir(house_target, "eagle3", tmp_path / "eagle3")
    out = tmp_path / "bench"
    proc = cli("bench", "--target", str(house_target), "--speculator", str(spec), "--workloads",
               "data/workloads/code-completion.jsonl", "--rows-per-cohort", "1", "--temperatures", "0,1", "--device", "cpu",
               "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| cohort | method | tok/s | × plain | × HF generate | tau |" in proc.stdout
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.md").read_text().startswith("# speculators bench")
    methods = {"plain", "ngram", "eagle3:eagle3", "eagle3+ngram:eagle3", "hf", "hf-assisted"}  # + the graft row
    for temperature in ("0.0", "1.0"):
        cohorts = report["results"][temperature]
        assert set(cohorts) == {"code-completion", "all"}
        assert set(cohorts["all"]) == methods
        for name, entry in cohorts["all"].items():
            assert entry["tokens"] > 0 and entry["tokens_per_second"] > 0 and entry["vs_plain"] > 0
            if name in ("plain", "ngram", "eagle3:eagle3", "eagle3+ngram:eagle3"):
                assert entry["tau"] >= 1.0
    greedy = report["results"]["0.0"]["all"]
    assert all(greedy[m]["mismatched_rows"] == 0
               for m in ("ngram", "eagle3:eagle3", "eagle3+ngram:eagle3", "hf", "hf-assisted"))
