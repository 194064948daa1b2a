"""Two "nodes" on one machine: two `speculators train` launchers, each with its own accelerate config (num_machines 2,
machine_rank 0 / 1, rendezvous on 127.0.0.1), one process per node. Both launchers end with status 0 and report
rank 0's summary — node 1 included, which never sees rank 0's result file (the bug: it ended with an error)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from speculators.core.workers import free_port
from tests.unit.train.train_helpers import (
    REPO,
    SPECULATORS_BIN,
    cli_env,
    prepare,
    recipe_dict,
    write_recipe,
    write_rows,
)

pytestmark = pytest.mark.distributed


def test_every_node_reports_rank_zeros_summary(tmp_path: Path, tiny_llama: Path) -> None:
    rows = write_rows(tmp_path / "rows.jsonl", 24)
    port = free_port()
    procs = []
    for node in (0, 1):
        config = tmp_path / f"node{node}.yaml"
        config.write_text(yaml.safe_dump({
            "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_machines": 2,
            "machine_rank": node, "num_processes": 2, "main_process_ip": "127.0.0.1", "main_process_port": port,
            "mixed_precision": "no", "use_cpu": False, "gpu_ids": "all", "rdzv_backend": "static",
            "same_network": True, "main_training_function": "main"}))
        data = recipe_dict(tmp_path / "run", tiny_llama, rows, train={
            "max_steps": 4, "eval_every": 4, "save_every": 4, "accelerate_config": str(config)})
        if node == 0:
            prepare(data)  # the shared storage both nodes read (one machine here)
        recipe = write_recipe(tmp_path / f"recipe{node}.yaml", data)
        procs.append(subprocess.Popen([str(SPECULATORS_BIN), "train", str(recipe)], cwd=REPO, env=cli_env(1),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for node, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"node {node}: {out[-1500:]}{err[-3000:]}"
    summary = json.loads((tmp_path / "run" / "checkpoints" / "train-summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 4
    for node, (out, _) in enumerate(outs):  # each launcher prints the summary it got: rank 0's
        flat = " ".join(out.split())
        for key in ("train_seconds", "tokens_per_cpu_second"):
            assert f"{key} │ {json.dumps(summary[key])}" in flat, (node, key, summary[key], out[-2500:])
