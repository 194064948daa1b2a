"""The files the package ships (core/package_data.py) and where the target of a recipe is resolved (load_recipe).

- In a clone every shipped folder is the top-level one (MANIFEST.in ships the same list in an sdist); a relative shipped path that is not where the user runs
  (the working directory outside the clone) names the package's copy, a path that is there wins, anything else is
  unchanged; `TargetConfig`, `DataSource` and the workload globs go through it.
- Nothing in the package reaches repository data through `__file__`: `package_data` is the only resolver.
- `load_recipe` resolves a `package:` target to the folder the CLI resolves it to (`fetch-target`), from a prepared
  cache (no network); `resolve_target=False` keeps it as written; a missing .gguf target fails in `load_recipe`.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from speculators.cli import main
from speculators.core import package_data
from speculators.core.config import DataSource, TargetConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.package_data import SHIPPED, locate, locate_glob, shipped, shipped_root
from speculators.core.recipes import load_recipe
from speculators.core.workloads import expand_paths

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "speculators"


def test_in_a_clone_the_shipped_folders_are_the_top_level_ones() -> None:
    assert shipped_root() == REPO.resolve()
    for rel in SHIPPED:
        assert shipped(rel).is_dir() and shipped(rel) == REPO.resolve() / rel, rel
    assert shipped("data/shapes/llama-3.1-8b.json").is_file()
    assert (shipped("serving/vllm/cpu-fixes") / "sitecustomize.py").is_file()
    with pytest.raises(ValueError, match="not inside a shipped folder"):
        shipped("data/speculators/stdlib-lm-eagle3")


def test_the_sdist_carries_the_same_folders() -> None:
    """MANIFEST.in grafts exactly `SHIPPED` (setup.py reads `SHIPPED` itself for the wheel)."""
    grafts = [line.split()[1] for line in (REPO / "MANIFEST.in").read_text().splitlines()
              if line.startswith("graft ")]
    assert grafts == list(SHIPPED)


def test_a_shipped_path_outside_the_clone_names_the_package_copy(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    house = str(REPO.resolve() / "data" / "targets" / "stdlib-lm")
    assert locate("data/targets/stdlib-lm") == locate("./data/targets/stdlib-lm/") == house
    assert TargetConfig().name_or_path == house  # the runtime's default target (bench, generate, serve)
    assert TargetConfig(name_or_path="HuggingFaceTB/SmolLM2-135M").name_or_path == "HuggingFaceTB/SmolLM2-135M"
    chat = "data/datasets/stdlib-chat/train.jsonl"
    assert DataSource(path=chat).path == str(REPO.resolve() / chat)
    for other in ("data/nope", "data/speculators/stdlib-lm-eagle3", "org/name", "", "/abs/data/workloads"):
        assert locate(other) == other
    assert locate_glob("data/workloads/*.jsonl") == str(REPO.resolve() / "data" / "workloads" / "*.jsonl")
    assert locate_glob("data/workloads/none-*.jsonl") == "data/workloads/none-*.jsonl"
    assert [p.name for p in expand_paths(["data/workloads/prose.jsonl"])] == ["prose.jsonl"]


def test_a_path_where_the_user_runs_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "targets" / "stdlib-lm").mkdir(parents=True)
    (tmp_path / "data" / "workloads").mkdir(parents=True)
    (tmp_path / "data" / "workloads" / "mine.jsonl").write_text("")
    assert TargetConfig().name_or_path == "data/targets/stdlib-lm"
    assert locate_glob("data/workloads/*.jsonl") == "data/workloads/*.jsonl"
    assert expand_paths(["data/workloads/*.jsonl"]) == [Path("data/workloads/mine.jsonl")]


def test_only_package_data_locates_repository_files() -> None:
    """No module reaches a folder beside the package through `__file__` (`Path(__file__).parents[2] / "data"`):
    in an installed wheel there is none. `package_data` finds the package with importlib.resources."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "parents":
                inner = ast.unparse(node.value)
                if "__file__" in inner:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {inner}.parents")
    assert not offenders, "locate shipped files with speculators.core.package_data:\n" + "\n".join(offenders)
    assert "__file__" not in Path(package_data.__file__).read_text()


def _cached_package_target(cache: Path) -> Path:
    """A converted `package:smollm2-135m-instruct` folder as target_sources leaves it (config + provenance)."""
    folder = cache / "targets" / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "provenance.json").write_text(json.dumps({"source": "package:smollm2-135m-instruct"}))
    return folder


def test_load_recipe_resolves_a_packaged_target_as_the_cli_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECULATORS_CACHE", str(cache))
    folder = _cached_package_target(cache)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\ntarget:\n  name_or_path: package:smollm2-135m-instruct\n")

    assert load_recipe(recipe).target.name_or_path == str(folder)
    assert load_recipe(recipe, resolve_target=False).target.name_or_path == "package:smollm2-135m-instruct"
    override = load_recipe(None, ["target.name_or_path=package:smollm2-135m-instruct"])
    assert override.target.name_or_path == str(folder)
    with pytest.raises(SystemExit) as done:
        main(["fetch-target", "package:smollm2-135m-instruct"])
    assert done.value.code in (0, None)
    assert capsys.readouterr().out.strip() == str(folder)  # the CLI's resolution: the same folder


def test_load_recipe_fails_on_a_missing_gguf_target(tmp_path: Path) -> None:
    with pytest.raises(SpeculatorsError, match="GGUF target not found"):
        load_recipe(None, [f"target.name_or_path={tmp_path / 'absent.gguf'}"])
    assert load_recipe(None, [f"target.name_or_path={tmp_path / 'absent.gguf'}"],
                       resolve_target=False).target.name_or_path.endswith("absent.gguf")
