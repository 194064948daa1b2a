"""The package works where pip puts it: a wheel built from the clone, installed (not editable) in a fresh venv and
run from a folder outside the clone, reads every file it needs from itself (core/package_data.py).

The wheel is built from a copy of the build inputs (pyproject.toml, setup.py, MANIFEST.in, README.md, the package and
the shipped data folders), offline (`--no-build-isolation`: this environment's setuptools). The venv has no pip and
no packages of its own but the wheel; it sees this environment's installed dependencies through one .pth line naming
their site-packages (a path line: the .pth files there, the editable install's finder among them, are not run), so
nothing is downloaded. From a folder outside the clone it runs `speculators --help`, `profile` of a shape from the
package (llama-3.1-8b where a GPU holds it; on a CPU tiny-llama, and the llama-3.1-8b shape read in Python), a short
`bench` on the house target the package falls back to, and `run` of a tiny recipe that names the house target, chat
data and workloads by their repository paths (`data/...`), which only the installed copies can answer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from speculators.core.package_data import INSTALLED_DIR, SHIPPED

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BUILD_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md")
TINY_RECIPE = """\
name: tiny-eagle3
run_dir: run
target:
  name_or_path: data/targets/stdlib-lm
data:
  sources:
    - path: data/datasets/stdlib-chat/train.jsonl
      max_rows: 40
  max_length: 160
  val_fraction: 0.1
  regenerate: {enabled: false}
capture: {layer_ids: [2, 4, 7], shard_tokens: 4096}
speculator: {family: eagle3, num_steps: 3, draft_vocab_size: 1024}
train: {max_steps: 4, batch_size: 4, eval_every: 2, save_every: 2, log_every: 1, trackers: [jsonl]}
evaluate:
  workloads: ["data/workloads/[ps]*.jsonl"]
  max_rows_per_cohort: 1
  live_rows_per_cohort: 1
  temperatures: [0.0]
vllm: {mode: never}
"""


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "speculators", src / "speculators", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for rel in SHIPPED:
        shutil.copytree(REPO / rel, src / rel, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(tmp / "wheels")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp / "wheels").glob("speculators-*.whl")
    return wheel


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "_speculators_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = _build_wheel(tmp)
    venv = _fresh_venv(tmp, wheel)
    work = tmp / "work"  # outside the clone: no data/, no recipes/ here
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               WANDB_MODE="offline", SPECULATORS_CACHE=str(tmp / "cache"), PATH=f"{venv / 'bin'}:{env['PATH']}")
    return {"wheel": wheel, "venv": venv, "work": work, "env": env}


def _run(installed: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`args` (a command in the venv's bin/) from the folder outside the clone; it must succeed."""
    cmd = [str(installed["venv"] / "bin" / args[0]), *args[1:]]
    done = subprocess.run(cmd, cwd=installed["work"], env=installed["env"], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done


def test_the_wheel_carries_the_shipped_files_and_the_venv_imports_it(installed: dict) -> None:
    import zipfile

    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for rel in SHIPPED:
        assert any(n.startswith(f"speculators/{INSTALLED_DIR}/{rel}/") for n in names), rel
    assert f"speculators/{INSTALLED_DIR}/data/targets/stdlib-lm/model.safetensors" in names
    assert not any(n.startswith(("data/", "serving/")) for n in names)  # nothing outside the package
    assert installed["wheel"].stat().st_size < 40 * 2**20
    code = ("import json, sys, speculators; from speculators.core.package_data import shipped_root; "
            "from speculators.oracle.shapes import shape_config; "
            "print(json.dumps([speculators.__file__, str(shipped_root()), sys.path, shape_config('llama-3.1-8b')[0]]))")
    where, root, path, shape = json.loads(_run(installed, "python", "-c", code).stdout)
    venv = str(installed["venv"])
    assert where.startswith(venv + "/") and root.startswith(venv + "/") and root.endswith(INSTALLED_DIR)
    assert str(REPO) not in path and shape == "llama-3.1-8b"


def test_help_and_profile_of_a_shape(installed: dict) -> None:
    assert "Train, evaluate, export and serve" in _run(installed, "speculators", "--help").stdout
    import torch

    big = torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 40 * 2**30
    shape = "llama-3.1-8b" if big else "tiny-llama"  # an 8B model of random weights does not fit a CPU runner
    out = _run(installed, "speculators", "profile", "--shape", shape, "--acceptance", "0.8,0.6", "--batch-sizes",
               "1", "--nodes", "1,4", "--max-depth", "2", "--context-len", "32", "--budget-s", "20", "--threads", "1",
               "--out", "profile", timeout=600).stdout
    assert f"# speculators profile — shape:{shape}" in out
    assert json.loads((installed["work"] / "profile" / "profile.json").read_text())["format"] == \
        "speculators.profile/v1"


def test_bench_on_the_house_target_the_package_ships(installed: dict) -> None:
    _run(installed, "speculators", "bench", "--rows-per-cohort", "1", "--temperatures", "0", "--no-hf", "--device",
         "cpu", "--threads", "1", "--ngram-graft", "0", "--workloads", "data/workloads/[ps]*.jsonl", "--out", "bench")
    report = json.loads((installed["work"] / "bench" / "bench.json").read_text())
    assert report["target"].startswith(str(installed["venv"]) + "/")
    assert report["target"].endswith(f"{INSTALLED_DIR}/data/targets/stdlib-lm") and report["rows"] == 2
    assert {"plain", "ngram"} <= set(report["results"]["0.0"]["all"])


def test_run_of_a_tiny_recipe_naming_shipped_data(installed: dict) -> None:
    (installed["work"] / "tiny.yaml").write_text(TINY_RECIPE)
    out = _run(installed, "speculators", "run", "tiny.yaml", timeout=600).stdout
    assert "export" in out
    run = installed["work"] / "run"
    pairing = json.loads((run / "export" / "pairing.json").read_text())
    assert pairing["target"]["name_or_path"].startswith(str(installed["venv"]) + "/")
    assert (run / "export" / "config.json").is_file() and (run / "eval" / "selection.json").is_file()
