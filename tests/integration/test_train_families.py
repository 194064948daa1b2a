"""All three families train briefly through the real CLI on the house target (prepare -> capture -> train, the
house recipes with fewer rows and steps), and the EAGLE-3 run logs to JSONL, TensorBoard and an offline W&B run dir
without touching the network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.train.train_helpers import REPO, cli_env, jsonl, run_cli, write_rows

pytestmark = pytest.mark.integration


def _overrides(run_dir: Path, rows: Path, trackers: str) -> list[str]:
    return [f"run_dir={run_dir}", f"data.sources=[{{path: {rows}}}]", "data.regenerate.enabled=false",
            "data.max_length=160", "data.val_fraction=0.1", "capture.shard_tokens=4096", "train.max_steps=8",
            "train.batch_size=4", "train.eval_every=4", "train.save_every=4", "train.log_every=1",
            f"train.trackers={trackers}"]


@pytest.mark.parametrize("family", ["eagle3", "medusa", "mtp", "dflash"])
def test_family_trains_through_the_cli(family: str, tmp_path: Path, house_target: Path) -> None:
    rows = write_rows(tmp_path / "rows.jsonl", 48)
    run_dir = tmp_path / "run"
    trackers = "[jsonl, tensorboard, wandb]" if family == "eagle3" else "[jsonl]"
    env = cli_env(1)
    env["WANDB_BASE_URL"] = "http://127.0.0.1:9"  # a dead port: an online attempt could not reach anything
    res = run_cli(["run", str(REPO / "recipes" / f"house-{family}.yaml"), *_overrides(run_dir, rows, trackers),
                   "--only", "prepare,capture,train"], env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]

    summary = json.loads((run_dir / "checkpoints" / "train-summary.json").read_text())
    assert summary["family"] == family and summary["steps"] == 8 and summary["mode"] == "offline"
    assert summary["tokens_per_s_per_process"] > 0 and summary["peak_memory_mb"] > 0
    loss = {r["step"]: r["loss"] for r in jsonl(run_dir)}
    assert sorted(loss) == list(range(1, 9))
    ev = jsonl(run_dir, "eval")
    assert [r["step"] for r in ev] == [4, 8]
    assert ev[1]["val_loss"] < ev[0]["val_loss"], ev  # it learns (held-out loss; train batches are noisy)
    import yaml

    k = yaml.safe_load((REPO / "recipes" / f"house-{family}.yaml").read_text())["speculator"]["num_steps"]
    assert len(ev[-1]["per_position_acceptance"]) == len(ev[-1]["val_top1_accuracy"]) == k
    assert ev[-1]["simulated_tau"] >= 1.0 and ev[-1]["acceptance_table"][0]["k"] == 1
    assert (run_dir / "logs" / "plots" / "acceptance-step-0000008.png").stat().st_size > 1000

    # the best/latest checkpoints load with the target's frozen tensors and carry the pairing
    from transformers import AutoModelForCausalLM

    from speculators.core.pairing import read_pairing
    from speculators.models.io import load_speculator, target_weights

    ckpt_root = run_dir / "checkpoints"
    best = ckpt_root / (ckpt_root / "best").read_text().strip()
    assert (ckpt_root / (ckpt_root / "latest").read_text().strip()).name == "step-0000008"
    spec = load_speculator(best, target_weights(AutoModelForCausalLM.from_pretrained(house_target)))
    assert spec.family == family
    pairing = read_pairing(best)
    assert pairing["draft"]["family"] == family and pairing["target"]["name_or_path"].endswith("stdlib-lm")
    native = json.loads((best / "config.json").read_text())["speculators_native"]
    assert native["recipe"]["speculator"]["family"] == family and "torch" in native["versions"]
    assert native["target"]["content_hash"] == pairing["target"]["content_hash"]

    if family == "eagle3":
        assert list((run_dir / "logs" / "tensorboard").glob("events.out.tfevents.*"))
        runs = list((run_dir / "logs" / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, runs
        blob = b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))
        assert b"train/loss" in blob and b"eval/simulated_tau" in blob
        assert not list((run_dir / "logs" / "wandb").glob("run-*"))  # no online run dir


def test_train_bench_through_the_cli(tmp_path: Path, house_target: Path) -> None:
    """`speculators train-bench` runs the real capture + training of a family in its own process (it passes
    train.eval_every=0: evaluation only with the final checkpoint) and writes its table's numbers."""
    out = tmp_path / "bench"
    res = run_cli(["train-bench", "--families", "eagle3", "--steps", "3", "--batch-size", "2", "--out", str(out),
                   "--data", str(write_rows(tmp_path / "rows.jsonl", 40))], timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    (result,) = json.loads((out / "train-bench.json").read_text())
    assert result["family"] == "eagle3" and result["steps"] == 3 and result["batch_size"] == 2
    assert result["tokens_per_s_per_process"] > 0 and result["peak_memory_mb"] > 0 and result["capture_seconds"] > 0
    assert "training benchmark" in res.stdout
    bad = run_cli(["train-bench", "--families", "eagle4", "--out", str(tmp_path / "bad")], timeout=120)
    assert bad.returncode != 0 and "eagle4" in bad.stderr and not (tmp_path / "bad").exists()
