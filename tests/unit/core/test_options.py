"""The command options (speculators/core/options.py) and the one tree-flag builder (config.tree_config): every flag has
help, the CLI's flags are the dataclasses' fields, and the tree flags build the same TreeConfig for every command."""

from __future__ import annotations

import dataclasses

import pytest
import typer

from speculators.cli import app
from speculators.core import options
from speculators.core.config import TreeConfig, tree_config
from speculators.core.errors import SpeculatorsError

COMMANDS = {"generate": options.GenerateOptions, "serve": options.ServeOptions, "bench": options.BenchOptions,
            "profile": options.ProfileOptions, "train-bench": options.TrainBenchOptions,
            "build-house": options.BuildHouseOptions, "fetch-target": options.FetchTargetOptions,
            "curves": options.CurvesOptions}


def test_every_option_has_help_and_is_a_flag_of_its_command() -> None:
    commands = typer.main.get_command(app).commands
    for name, cls in COMMANDS.items():
        params = {p.name: p for p in commands[name].params}
        assert commands[name].help == " ".join(cls.__doc__.split())
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
            if f.metadata.get("cli", True):
                assert f.name in params, f"{name} has no flag for {f.name}"
                if f.default is not dataclasses.MISSING:
                    assert params[f.name].default == f.default, (name, f.name)


def test_flags_keep_their_spelling() -> None:
    commands = typer.main.get_command(app).commands
    opts = {name: {o for p in c.params for o in [*p.opts, *getattr(p, "secondary_opts", [])]}
            for name, c in commands.items()}
    assert {"--json", "--max-new-tokens", "--allow-revision-mismatch", "--no-allow-revision-mismatch"} <= \
        opts["generate"]
    assert {"--speculator", "--hf", "--no-hf", "--adaptive", "--no-adaptive", "--rows-per-cohort"} <= opts["bench"]
    assert {"--data-only"} <= opts["build-house"] and "--no-data-only" not in opts["build-house"]
    assert {"--host", "--port", "--max-batch-size", "--recipe", "--allow-revision-mismatch"} <= opts["serve"]
    assert "--rows" not in opts["train-bench"] and "--recipes-dir" not in opts["train-bench"]  # code-only settings


def test_no_tree_flag_keeps_the_drafters_own() -> None:
    assert tree_config(None, None, None, None, None) is None


def test_tree_flags_over_the_defaults_and_over_a_drafters_tree() -> None:
    assert tree_config("chain", 3, None, None, False) == TreeConfig(kind="chain", depth=3, topk=1, budget=3,
                                                                     adaptive=False)
    assert tree_config(None, 2, None, None, None) == dataclasses.replace(TreeConfig(), depth=2)
    own = TreeConfig(kind="static", depth=4, topk=3, budget=10, choices=[[0], [0, 0]], adaptive=False)
    assert tree_config(None, None, None, 6, None, base=own) == dataclasses.replace(own, budget=6)
    chain = tree_config("chain", None, None, None, None, base=own)
    assert (chain.kind, chain.depth, chain.topk, chain.budget, chain.adaptive) == ("chain", 4, 1, 4, False)


@pytest.mark.parametrize(("args", "words"), [(("bogus", None, None, None, None), "--tree"),
                                             ((None, 0, None, None, None), "--depth"),
                                             ((None, None, None, -1, None), "--budget")])
def test_tree_flag_errors_are_one_line(args: tuple, words: str) -> None:
    with pytest.raises(SpeculatorsError, match=words):
        tree_config(*args)


def test_list_flags_and_threads() -> None:
    assert options.choices("eagle3, mtp", "--families", ("eagle3", "mtp")) == ["eagle3", "mtp"]
    assert options.floats("0,1", "--temperatures") == [0.0, 1.0]
    assert options.ints(None, "--nodes") is None and options.ints("1,2", "--nodes") == [1, 2]
    for bad in (lambda: options.choices("eagle4", "--families", ("eagle3",)),
                lambda: options.floats("a", "--temperatures"), lambda: options.BenchOptions(threads=-1)):
        with pytest.raises(SpeculatorsError):
            bad()
