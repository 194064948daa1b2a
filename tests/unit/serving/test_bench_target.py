"""`speculators bench` without --target benches the target the speculator was trained for (its pairing.json), not
the house target, on which a speculator of another target would not even load."""

from __future__ import annotations

from speculators.core.config import TargetConfig
from speculators.serving.bench import bench_target
from tests.unit.runtime.runtime_helpers import make_speculator_dir


def test_bench_target_defaults_to_the_speculators_paired_target(tiny_qwen3, tmp_path) -> None:
    spec = make_speculator_dir(tiny_qwen3, "eagle3", tmp_path / "spec")
    assert bench_target(None, [str(spec), "ngram"]).name_or_path == str(tiny_qwen3)
    assert bench_target("some/dir", [str(spec)]).name_or_path == "some/dir"
    assert bench_target(None, []).name_or_path == TargetConfig().name_or_path
