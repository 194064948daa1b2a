"""Recipes: strict keys, types, dotted overrides, closest-key hints."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.recipes import dump_recipe, load_recipe, recipe_from_dict, to_dict

REPO = Path(__file__).resolve().parents[3]


def test_every_shipped_recipe_loads() -> None:
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert recipes, "no recipes shipped"
    for path in recipes:
        recipe = load_recipe(path)
        assert recipe.name and recipe.run_dir


def test_roundtrip_dump_and_load(tmp_path: Path) -> None:
    recipe = load_recipe(REPO / "recipes" / "house-eagle3.yaml", ["train.lr=3e-4", "speculator.num_steps=3"])
    assert recipe.train.lr == pytest.approx(3e-4)
    assert recipe.speculator.num_steps == 3
    out = tmp_path / "r.yaml"
    out.write_text(dump_recipe(recipe))
    again = load_recipe(out)
    assert to_dict(again) == to_dict(recipe)


def test_unknown_key_names_the_closest(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lrr: 0.1\n")
    with pytest.raises(SpeculatorsError, match=r"unknown recipe key 'train.lrr'; did you mean 'train.lr'"):
        load_recipe(bad)


def test_unknown_section(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trian:\n  lr: 0.1\n")
    with pytest.raises(SpeculatorsError, match=r"'trian'.*'train'"):
        load_recipe(bad)


def test_override_typo_and_type_errors() -> None:
    with pytest.raises(SpeculatorsError, match=r"train.epoch.*train.epochs"):
        load_recipe(None, ["train.epoch=3"])
    with pytest.raises(SpeculatorsError, match=r"train.batch_size: expected an integer"):
        load_recipe(None, ["train.batch_size=abc"])
    with pytest.raises(SpeculatorsError, match=r"speculator.draft_arch: 'lama' is not one of"):
        load_recipe(None, ["speculator.draft_arch=lama"])
    with pytest.raises(SpeculatorsError, match=r"section.key=value"):
        load_recipe(None, ["train.lr"])


def test_nested_lists_of_sections() -> None:
    recipe = recipe_from_dict({"data": {"sources": [{"path": "a.jsonl", "schema": "sharegpt"}]}})
    assert recipe.data.sources[0].schema == "sharegpt"
    with pytest.raises(SpeculatorsError, match=r"data.sources\[0\].fromat"):
        recipe_from_dict({"data": {"sources": [{"path": "a.jsonl", "fromat": "x"}]}})


def test_invalid_yaml_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(SpeculatorsError, match=r"not valid YAML at line"):
        load_recipe(bad)


def test_defaults_and_paths() -> None:
    recipe = Recipe(run_dir="runs/x")
    assert recipe.paths.features == Path("runs/x/features")
    assert recipe.training_data_dir == recipe.paths.prepared
    recipe.data.regenerate.enabled = True
    assert recipe.training_data_dir == recipe.paths.regenerated


def test_override_one_item_of_a_list_of_sections() -> None:
    recipe = load_recipe(REPO / "recipes" / "house-eagle3.yaml",
                         ["data.sources.1.max_rows=300", "data.sources.0.schema=sharegpt"])
    assert [s.max_rows for s in recipe.data.sources] == [3000, 300]
    assert recipe.data.sources[0].schema == "sharegpt" and recipe.data.sources[1].schema != "sharegpt"
    with pytest.raises(SpeculatorsError, match=r"'data.sources.2'.*has 2 item\(s\).*index 0..1"):
        load_recipe(REPO / "recipes" / "house-eagle3.yaml", ["data.sources.2.max_rows=3"])
    with pytest.raises(SpeculatorsError, match=r"'data.sources.first'.*index 0..1"):
        load_recipe(REPO / "recipes" / "house-eagle3.yaml", ["data.sources.first.max_rows=3"])
    with pytest.raises(SpeculatorsError, match=r"unknown recipe key 'data.sources.0.max_row'.*max_rows"):
        load_recipe(REPO / "recipes" / "house-eagle3.yaml", ["data.sources.0.max_row=3"])
    with pytest.raises(SpeculatorsError, match=r"'data.sources.0'.*data.sources is empty"):
        load_recipe(None, ["data.sources.0.max_rows=3"])
