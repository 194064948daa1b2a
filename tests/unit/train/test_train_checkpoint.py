"""Checkpoints: atomic writes (a crash mid-write never corrupts the last good one), keep-last-N that never drops
`best`/`latest`, pointer files, resume-state round trip (weights, optimizer, RNG, trainer state), resume lookup."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from speculators.core.checkpoints import step_number
from speculators.core.config import Recipe, SpeculatorConfig
from speculators.core.errors import SpeculatorsError
from speculators.train import checkpoint as ck

FP = {"name_or_path": "tiny", "revision": "local:abc", "content_hash": "c" * 64, "tokenizer_hash": "t" * 64,
      "adapter": None, "adapter_revision": None, "architectures": ["LlamaForCausalLM"], "num_layers": 8,
      "hidden_size": 64, "vocab_size": 0}


@pytest.fixture()
def rig(tiny_llama: Path):
    """A real single-process accelerate setup around a tiny EAGLE-3 speculator."""
    from transformers import AutoModelForCausalLM

    from speculators.models import SPECULATORS
    from speculators.models.io import target_weights
    from speculators.train.accelerator import make_accelerator, train_module_class

    target = AutoModelForCausalLM.from_pretrained(tiny_llama)
    weights = target_weights(target)
    torch.manual_seed(0)
    spec = SPECULATORS["eagle3"].from_target(target.config, SpeculatorConfig(num_steps=1), weights)
    recipe = Recipe()
    recipe.target.device = "cpu"
    acc = make_accelerator(recipe)
    module = train_module_class()(spec)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(module, opt)
    fp = dict(FP, vocab_size=int(target.config.vocab_size))
    return acc, model, opt, spec, weights, fp


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (2, 6), generator=g)
    taps = torch.randn(2, 6, 3 * 64, generator=g)
    logits = model({"input_ids": ids, "attention_mask": torch.ones_like(ids), "taps": taps})
    logits[0].float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _save(writer, spec, fp, step: int, best: bool) -> Path:
    return writer.save(step, lambda: spec, metadata={"family": "eagle3", "step": step}, target_fp=fp,
                       layer_ids=list(spec.layer_ids), recipe={"name": "t"},
                       trainer_state={"step": step, "micro_step": step, "world_size": 1}, evaluation=None,
                       is_best=best)


def test_keep_last_n_keeps_best_and_pointers(tmp_path: Path, rig) -> None:
    acc, model, opt, spec, _, fp = rig
    writer = ck.CheckpointWriter(tmp_path, acc, keep_last=2)
    writer.install_hooks(model)
    for step in range(1, 6):
        _step(model, opt, step)
        _save(writer, spec, fp, step, best=step == 2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["best", "latest", "step-0000002", "step-0000004", "step-0000005"]
    assert ck.read_pointer(tmp_path, "latest").name == "step-0000005"
    assert ck.read_pointer(tmp_path, "best").name == "step-0000002"
    assert [step_number(p) for p in ck.list_checkpoints(tmp_path)] == [2, 4, 5]
    ckpt = tmp_path / "step-0000005"
    pairing = json.loads((ckpt / "pairing.json").read_text())
    assert pairing["target"]["content_hash"] == fp["content_hash"] and pairing["draft"]["family"] == "eagle3"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["speculators_native"]["step"] == 5
    # frozen target copies are not duplicated into training_state
    from safetensors import safe_open

    with safe_open(str(ckpt / "training_state" / "model.safetensors"), framework="pt") as fh:
        keys = list(fh.keys())
    assert keys and not [k for k in keys if "embed_tokens" in k]


def test_crash_mid_write_leaves_last_good_checkpoint(tmp_path: Path, rig, monkeypatch) -> None:
    acc, model, opt, spec, _, fp = rig
    writer = ck.CheckpointWriter(tmp_path, acc, keep_last=3)
    writer.install_hooks(model)
    _save(writer, spec, fp, 1, best=True)
    before = (tmp_path / "step-0000001" / "model.safetensors").read_bytes()

    def crash(*a, **k):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(ck, "save_speculator", crash)
    with pytest.raises(OSError):
        _save(writer, spec, fp, 2, best=True)
    assert [step_number(p) for p in ck.list_checkpoints(tmp_path)] == [1]  # the half-written step 2 is not a checkpoint
    assert ck.read_pointer(tmp_path, "latest").name == "step-0000001"
    assert ck.find_resume("auto", tmp_path).name == "step-0000001"
    assert (tmp_path / "step-0000001" / "model.safetensors").read_bytes() == before
    assert (tmp_path / ".tmp-step-0000002").exists()
    (tmp_path / ".best.tmp4242").write_text("step-0000002")  # a pointer write killed before its rename
    ck.clean_partial(tmp_path)
    assert not (tmp_path / ".tmp-step-0000002").exists() and not (tmp_path / ".best.tmp4242").exists()
    assert (tmp_path / "step-0000001").is_dir()


def test_resume_state_round_trip(tmp_path: Path, rig, tiny_llama: Path) -> None:
    acc, model, opt, spec, weights, fp = rig
    writer = ck.CheckpointWriter(tmp_path, acc, keep_last=2)
    writer.install_hooks(model)
    for s in range(3):
        _step(model, opt, s)
    saved = _save(writer, spec, fp, 3, best=True)
    want_weights = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = copy.deepcopy(opt.state_dict())
    want_rand = torch.rand(4)  # the RNG stream right after the save
    _step(model, opt, 99)  # move everything on

    from speculators.models import SPECULATORS
    from speculators.train.accelerator import make_accelerator, train_module_class

    recipe = Recipe()
    recipe.target.device = "cpu"
    acc2 = make_accelerator(recipe)
    torch.manual_seed(123)
    spec2 = SPECULATORS["eagle3"].from_target(_cfg(tiny_llama), SpeculatorConfig(num_steps=1), weights)
    module2 = train_module_class()(spec2)
    opt2 = torch.optim.AdamW([p for p in module2.parameters() if p.requires_grad], lr=1e-2)
    model2, opt2 = acc2.prepare(module2, opt2)
    w2 = ck.CheckpointWriter(tmp_path, acc2, keep_last=2)
    w2.load_state(saved)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want_weights[k]), k
    got_opt = opt2.state_dict()
    for pid, st in want_opt["state"].items():
        for name, t in st.items():
            assert torch.equal(got_opt["state"][pid][name], t), (pid, name)
    assert torch.equal(torch.rand(4), want_rand)
    assert ck.read_trainer_state(saved)["micro_step"] == 3


def _cfg(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def test_find_resume_modes(tmp_path: Path, rig) -> None:
    acc, model, opt, spec, _, fp = rig
    assert ck.find_resume("auto", tmp_path) is None
    writer = ck.CheckpointWriter(tmp_path, acc, keep_last=5)
    writer.install_hooks(model)
    _save(writer, spec, fp, 1, best=True)
    _save(writer, spec, fp, 2, best=False)
    assert ck.find_resume("never", tmp_path) is None
    assert ck.find_resume("auto", tmp_path).name == "step-0000002"
    assert ck.find_resume(str(tmp_path / "step-0000001"), tmp_path).name == "step-0000001"
    assert ck.find_resume(str(tmp_path), tmp_path / "elsewhere").name == "step-0000002"  # a checkpoints/ dir
    with pytest.raises(SpeculatorsError, match="not found"):
        ck.find_resume(str(tmp_path / "step-0000009"), tmp_path)
    (tmp_path / "step-0000002" / "pairing.json").unlink()
    with pytest.raises(SpeculatorsError, match="not a complete"):
        ck.find_resume(str(tmp_path / "step-0000002"), tmp_path)
    assert ck.find_resume("auto", tmp_path).name == "step-0000001"  # latest is incomplete: fall back


def test_check_resume_refuses_other_family_target_and_shape(tmp_path: Path, rig) -> None:
    acc, model, opt, spec, _, fp = rig
    writer = ck.CheckpointWriter(tmp_path, acc, keep_last=5)
    writer.install_hooks(model)
    path = _save(writer, spec, fp, 1, best=True)
    shapes = {n: tuple(p.shape) for n, p in spec.named_parameters() if p.requires_grad}
    assert ck.check_resume(path, "eagle3", fp, shapes)["step"] == 1
    with pytest.raises(SpeculatorsError, match="eagle3 checkpoint but the recipe trains medusa"):
        ck.check_resume(path, "medusa", fp, shapes)
    with pytest.raises(SpeculatorsError, match="trained for tiny@local:abc"):
        ck.check_resume(path, "eagle3", dict(fp, content_hash="x" * 64, revision="local:other"), shapes)
    bad = dict(shapes)
    bad["fc.weight"] = (1, 1)
    with pytest.raises(SpeculatorsError, match="fc.weight has shape"):
        ck.check_resume(path, "eagle3", fp, bad)
