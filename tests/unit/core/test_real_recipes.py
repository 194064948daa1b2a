"""The real-target recipes: `speculators run RECIPE --dry-run` resolves each one on CPU with the model hub offline and
an empty hub cache (no target config, no tokenizer, no dataset is read), to the target, family and launch settings a
GPU user expects; every accelerate / DeepSpeed file they name exists and parses; a typo'd key fails the dry run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig

from speculators.core.recipes import load_recipe, recipe_from_dict, to_dict
from speculators.train.launch import check_accelerate_config

REPO = Path(__file__).resolve().parents[3]
ACCELERATE = "recipes/accelerate"

# recipe file -> what it must resolve to (every recipe in recipes/ that is not a house recipe needs a row here)
REAL = {
    "llama-3.1-8b-eagle3.yaml": dict(target="meta-llama/Llama-3.1-8B-Instruct", family="eagle3", draft_arch="llama",
                                     capture="online", processes=8, accelerate="deepspeed-zero2.yaml", zero=2),
    "qwen3-8b-eagle3.yaml": dict(target="Qwen/Qwen3-8B", family="eagle3", draft_arch="llama",
                                 capture="online", processes=8, accelerate="deepspeed-zero2.yaml", zero=2),
    "qwen3-30b-a3b-eagle3.yaml": dict(target="Qwen/Qwen3-30B-A3B-Instruct-2507", family="eagle3", draft_arch="llama",
                                      capture="offline", processes=8, accelerate="deepspeed-zero3.yaml", zero=3),
    "gpt-oss-20b-eagle3.yaml": dict(target="openai/gpt-oss-20b", family="eagle3", draft_arch="llama",
                                    capture="online", processes=8, accelerate="deepspeed-zero2.yaml", zero=2),
}


def _offline_env(tmp_path: Path) -> dict[str, str]:
    """No hub: offline flags, an empty cache, and a proxy that refuses every connection."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("HF_", "HUGGINGFACE", "TRANSFORMERS"))}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "hf-home"), "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
            "NO_PROXY": "", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def _dry_run(recipe: Path, tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "speculators.cli", "run", str(recipe), *overrides, "--dry-run"],
                          cwd=REPO, env=_offline_env(tmp_path), capture_output=True, text=True, timeout=120)


def _check_launch_files(accelerate_config: str) -> dict:
    """The accelerate config (path as the recipe gives it, from the repo root) parses as accelerate's own config, and
    a DeepSpeed config it names exists and is JSON. Returns {"accelerate": ClusterConfig, "deepspeed": dict | None}."""
    path = REPO / accelerate_config
    assert path.is_file(), f"accelerate config {accelerate_config} does not exist"
    cluster = ClusterConfig.from_yaml_file(str(path))  # unknown keys raise
    deepspeed = None
    if str(cluster.distributed_type).upper().endswith("DEEPSPEED"):
        cfg = check_accelerate_config(str(path))  # the check `speculators train` runs before it launches
        ds_file = Path(cfg["deepspeed_config"]["deepspeed_config_file"])
        assert ds_file.is_file()
        deepspeed = json.loads(ds_file.read_text())
    return {"accelerate": cluster, "deepspeed": deepspeed}


# CPU recipes of a real target shipped in a package (`package:` sources, fetched from the package registry)
CPU_REAL = {
    "smollm2-eagle3.yaml": dict(family="eagle3", layer_ids=[2, 15, 27], draft_vocab_size=8192),
    "smollm2-dflash.yaml": dict(family="dflash", layer_ids=[2, 15, 27], draft_vocab_size=None),
    "smollm2-eagle3-adapt.yaml": dict(family="eagle3", layer_ids=[2, 15, 27], draft_vocab_size=8192, traffic=True),
}


def test_every_real_target_recipe_has_expectations() -> None:
    shipped = {p.name for p in (REPO / "recipes").glob("*.yaml") if not p.name.startswith("house-")}
    assert shipped == set(REAL) | set(CPU_REAL), "a real-target recipe was added or removed: give it a row in REAL"


@pytest.mark.parametrize("name", sorted(CPU_REAL))
def test_packaged_target_recipes_dry_run_without_fetching(name: str, tmp_path: Path) -> None:
    """The SmolLM2 recipes name their target as a package source; a dry run prints it as written and fetches
    nothing (no network, an empty cache); the data stages of the training recipes are the same (one comparison, same
    rows); the traffic recipe continues the EAGLE-3 recipe's export with its speculator's shape."""
    want = CPU_REAL[name]
    env = {**_offline_env(tmp_path), "SPECULATORS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "speculators.cli", "run", f"recipes/{name}", "--dry-run"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["target"]["name_or_path"] == "package:smollm2-135m-instruct"
    assert not (tmp_path / "cache").exists()
    assert resolved["speculator"]["family"] == want["family"]
    assert resolved["capture"]["layer_ids"] == want["layer_ids"]
    assert resolved["speculator"]["draft_vocab_size"] == want["draft_vocab_size"]
    assert resolved["target"]["dtype"] == "auto" and resolved["train"]["num_processes"] == 1
    eagle3 = to_dict(load_recipe(REPO / "recipes" / "smollm2-eagle3.yaml", resolve_target=False))  # no fetch
    mine = to_dict(load_recipe(REPO / "recipes" / name, resolve_target=False))
    if want.get("traffic"):
        assert mine["speculator"] == eagle3["speculator"] and mine["train"]["init_from"] == f"{eagle3['run_dir']}/export"
        assert [source["traffic"] for source in mine["data"]["sources"]] == ["runs/serve/smollm2-traffic"]
    else:
        assert mine["data"] == eagle3["data"]


@pytest.mark.parametrize("name", sorted(REAL))
def test_dry_run_resolves_offline(name: str, tmp_path: Path) -> None:
    want = REAL[name]
    path = REPO / "recipes" / name
    proc = _dry_run(path.relative_to(REPO), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    resolved = yaml.safe_load(proc.stdout)

    # the printed recipe is the whole recipe, loads back strictly and equals the file's
    assert to_dict(recipe_from_dict(resolved)) == to_dict(load_recipe(path)) == resolved
    assert not (tmp_path / "hf-home").exists()  # the hub cache was never touched

    assert resolved["name"] == path.stem and resolved["run_dir"] == f"runs/{path.stem}"
    assert resolved["target"]["name_or_path"] == want["target"]
    assert resolved["target"]["dtype"] == "bfloat16"
    assert resolved["speculator"]["family"] == want["family"]
    assert resolved["speculator"]["draft_arch"] == want["draft_arch"]
    assert resolved["capture"]["mode"] == want["capture"]
    train = resolved["train"]
    assert train["precision"] == "bf16"
    assert train["num_processes"] == want["processes"]
    assert train["accelerate_config"] == f"{ACCELERATE}/{want['accelerate']}"

    files = _check_launch_files(train["accelerate_config"])
    assert files["accelerate"].num_machines == 1
    assert files["deepspeed"] is not None and files["deepspeed"]["zero_optimization"]["stage"] == want["zero"]

    # regeneration talks to the endpoint the header tells the user to start
    regen = resolved["data"]["regenerate"]
    assert regen["enabled"] and regen["backend"] == "openai"
    port = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/v1", regen["endpoint"]).group(1)
    header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    assert re.search(rf"vllm serve {re.escape(want['target'])} --port {port}\b", header), header
    # every `speculators run recipes/...` line of the header resolves as written (stage names of --only included)
    runs = re.findall(r"^#\s+speculators run (recipes/\S+)([^#\n]*)", header, flags=re.M)
    assert runs and {r[0] for r in runs} == {f"recipes/{name}"}, runs
    for recipe, args in runs:
        proc = _dry_run(Path(recipe), tmp_path, *args.split())
        assert proc.returncode == 0 and yaml.safe_load(proc.stdout) == resolved, (args, proc.stderr)
    assert "Hardware:" in header and "ESTIMATES" in header


@pytest.mark.parametrize("name", sorted(REAL))
def test_typo_in_a_real_recipe_fails_the_dry_run(name: str, tmp_path: Path) -> None:
    text = (REPO / "recipes" / name).read_text()
    assert "\n  num_processes: " in text
    bad = tmp_path / name
    bad.write_text(text.replace("\n  num_processes: ", "\n  num_proceses: ", 1))
    proc = _dry_run(bad, tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown recipe key" in lines[0] and "num_proceses" in lines[0], proc.stderr
    assert "did you mean" in lines[0] and "num_processes" in lines[0]


def test_a_missing_accelerate_config_fails_the_check() -> None:
    with pytest.raises(AssertionError, match="does not exist"):
        _check_launch_files(f"{ACCELERATE}/deepspeed-zero4.yaml")


@pytest.mark.parametrize("path", sorted(p.name for p in (REPO / ACCELERATE).glob("*.yaml")))
def test_every_accelerate_config_parses(path: str) -> None:
    files = _check_launch_files(f"{ACCELERATE}/{path}")
    cluster = files["accelerate"]
    assert cluster.num_processes >= 1 and 0 <= cluster.machine_rank < cluster.num_machines


def test_multinode_config() -> None:
    files = _check_launch_files(f"{ACCELERATE}/deepspeed-zero2-multinode.yaml")
    cluster = files["accelerate"]
    assert cluster.num_machines == 2 and cluster.num_processes == 16 and cluster.machine_rank == 0
    assert cluster.main_process_ip and cluster.main_process_port
    assert cluster.deepspeed_config["deepspeed_multinode_launcher"] == "standard"  # torchrun per node, no pdsh
    assert files["deepspeed"]["zero_optimization"]["stage"] == 2
