"""Bad input to `speculators train`: one clear line each, and nothing is written or overwritten.

Shards captured from another target, a checkpoint of another family passed to resume, a draft vocab that does not
cover EOS, an accelerate config that does not exist (through the real CLI: `error: ...`, exit status 2)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from speculators.core.errors import SpeculatorsError
from tests.unit.train.train_helpers import capture, load, prepare, recipe_dict, run_cli, write_recipe, write_rows


def _tree(root: Path) -> dict[str, str]:
    """Every file under root with its sha256 (to prove nothing changed)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    write_rows(d / "rows.jsonl", 24)
    return d


def _prepared(base: Path, name: str, target: Path, **sections) -> dict:
    data = recipe_dict(base / name, target, base / "rows.jsonl", **sections)
    prepare(data)
    return data


def test_features_from_another_target_are_refused(base: Path, tiny_llama: Path, tiny_qwen3: Path) -> None:
    from speculators.train.train import run

    data = _prepared(base, "other-target", tiny_llama, capture={"mode": "offline", "teacher": "topk",
                                                               "teacher_topk": 4})
    capture(data)
    before = _tree(base / "other-target")
    data["target"]["name_or_path"] = str(tiny_qwen3)  # same tokenizer, different weights
    with pytest.raises(SpeculatorsError, match="come from target .* re-run capture") as info:
        run(load(data))
    assert "\n" not in str(info.value)
    assert _tree(base / "other-target") == before


def test_checkpoint_of_another_family_is_refused(base: Path, tiny_llama: Path) -> None:
    from speculators.train.train import run

    data = _prepared(base, "family", tiny_llama, train={"max_steps": 2, "save_every": 2, "eval_every": 2})
    summary = run(load(data))
    ckpt = Path(summary["latest_checkpoint"])
    before = _tree(base / "family")
    other = recipe_dict(base / "family-medusa", tiny_llama, base / "rows.jsonl",
                        speculator={"family": "medusa", "draft_vocab_size": None}, train={"resume": str(ckpt)})
    shutil.copytree(base / "family" / "prepared", base / "family-medusa" / "prepared")
    with pytest.raises(SpeculatorsError, match="it is a eagle3 checkpoint but the recipe trains medusa"):
        run(load(other))
    # same run dir, family changed: resume=auto finds the eagle3 checkpoint and refuses it too
    data["speculator"] = {"family": "medusa", "num_steps": 2}
    with pytest.raises(SpeculatorsError, match="eagle3 checkpoint but the recipe trains medusa"):
        run(load(data))
    # same family, other settings: resume=auto refuses to mix them and names the way out
    data["speculator"] = {"family": "eagle3", "num_steps": 2, "draft_vocab_size": 512}
    data["train"]["lr"] = 1.0e-5
    with pytest.raises(SpeculatorsError, match="trained with other settings .* --force"):
        run(load(data))
    assert _tree(base / "family") == before
    assert not (base / "family-medusa" / "checkpoints").exists() and not (base / "family-medusa" / "logs").exists()


def test_draft_vocab_without_eos_is_refused(base: Path, tiny_llama: Path) -> None:
    from speculators.data.vocab import save_vocab
    from speculators.train.train import run

    data = _prepared(base, "eos", tiny_llama)
    vd = data["speculator"]["draft_vocab_size"]
    from transformers import AutoConfig

    eos = AutoConfig.from_pretrained(tiny_llama).eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    vocab = int(AutoConfig.from_pretrained(tiny_llama).vocab_size)
    ids = [i for i in range(vocab) if i not in eos][:vd]
    d2t = torch.tensor(ids) - torch.arange(vd)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    features = base / "eos" / "features"
    features.mkdir(parents=True)
    save_vocab(features, d2t, t2d)
    before = _tree(base / "eos")
    with pytest.raises(SpeculatorsError, match=r"does not cover the target's EOS token id\(s\)"):
        run(load(data))
    assert _tree(base / "eos") == before


def test_missing_accelerate_config_is_one_line_through_the_cli(base: Path, tiny_llama: Path) -> None:
    data = _prepared(base, "accel", tiny_llama, train={"accelerate_config": "recipes/accelerate/nope.yaml"})
    before = _tree(base / "accel")
    res = run_cli(["train", str(write_recipe(base / "accel.yaml", data))], timeout=300)
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip() and "warn" not in line.lower()]
    assert lines == ["error: accelerate config not found: recipes/accelerate/nope.yaml (train.accelerate_config; "
                     "see recipes/accelerate/*.yaml)"]
    assert _tree(base / "accel") == before


def test_a_damaged_shard_fails_before_step_one(base: Path, tiny_llama: Path) -> None:
    from speculators.train.train import run

    data = _prepared(base, "damaged", tiny_llama, capture={"mode": "offline", "teacher": "topk", "teacher_topk": 4,
                                                          "shard_tokens": 128})
    capture(data)
    shards = sorted((base / "damaged" / "features").glob("shard-*.safetensors"))
    assert len(shards) >= 3
    last = shards[-1]  # the shard training would reach last
    raw = bytearray(last.read_bytes())
    for i in range(len(raw) - 64, len(raw)):  # tensor bytes at the end: the header still parses
        raw[i] ^= 0xFF
    last.write_bytes(bytes(raw))
    before = _tree(base / "damaged")
    with pytest.raises(SpeculatorsError, match=f"feature shard .*{last.name} fails its checksum; re-run capture") \
            as info:
        run(load(data))
    assert "\n" not in str(info.value)
    assert _tree(base / "damaged") == before  # no checkpoint, no log: it stopped before step 1
