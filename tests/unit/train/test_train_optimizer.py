"""`train.optimizer: muon` (train/optimizer.py): the float32 Newton-Schulz orthogonalisation at the SmolLM2 draft's
real matrix sizes, which parameters take Muon steps, the AdamW group equal to torch's AdamW, a real EAGLE-3 head
trained by it, and its state through a checkpoint round trip."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from speculators.core.config import SpeculatorConfig, TrainConfig
from speculators.core.errors import SpeculatorsError
from speculators.train.optimizer import (
    MuonAdamW,
    build_optimizer,
    check_optimizer_options,
    is_muon_matrix,
    orthogonalised,
)
from tests.unit.train.train_helpers import load, prepare, recipe_dict, write_rows


@pytest.mark.parametrize("shape", [(576, 1728), (1536, 576), (192, 1152)])  # fc, gate/up, k/v of SmolLM2's draft
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_orthogonalised_pushes_singular_values_towards_one(shape: tuple[int, int], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    grad = (torch.randn(shape, generator=g) * 1e-3).to(dtype)  # a gradient's scale: the result must not care
    grad[0] *= 50.0  # one dominant direction, as real gradients have
    out = orthogonalised(grad)
    assert out.dtype == torch.float32 and out.shape == shape
    s = torch.linalg.svdvals(out.double())
    assert s.max() < 1.3 and s.min() > 0.5, (s.min(), s.max())
    raw = torch.linalg.svdvals(grad.double())
    assert raw.max() / raw.min() > 30  # the input was far from orthogonal


def _eagle3(tiny_llama: Path, freeze: bool):
    from transformers import AutoModelForCausalLM

    from speculators.models import SPECULATORS
    from speculators.models.io import target_weights
    from speculators.train.accelerator import train_module_class

    target = AutoModelForCausalLM.from_pretrained(tiny_llama)
    torch.manual_seed(0)
    spec = SPECULATORS["eagle3"].from_target(target.config, SpeculatorConfig(num_steps=1, freeze_lm_head=freeze),
                                             target_weights(target))
    return train_module_class()(spec)


def test_muon_takes_the_weight_matrices_and_adamw_the_rest(tiny_llama: Path) -> None:
    module = _eagle3(tiny_llama, freeze=False)
    opt = build_optimizer(module, TrainConfig(optimizer="muon", lr=1e-3))
    assert isinstance(opt, MuonAdamW)
    by_id = {id(p): n for n, p in module.named_parameters()}
    muon = sorted(by_id[id(p)].split("spec.")[-1] for g in opt.param_groups if g["muon"] for p in g["params"])
    rest = sorted(by_id[id(p)].split("spec.")[-1] for g in opt.param_groups if not g["muon"] for p in g["params"])
    assert "fc.weight" in muon and any("q_proj" in n for n in muon) and any("down_proj" in n for n in muon)
    assert "lm_head.weight" in rest and all(not is_muon_matrix(n, p) for n, p in module.named_parameters()
                                            if n.split("spec.")[-1] in rest)
    assert not any("norm" in n for n in muon)
    adamw = build_optimizer(module, TrainConfig(optimizer="adamw"))
    assert type(adamw) is torch.optim.AdamW


def test_the_adamw_group_steps_as_torch_adamw() -> None:
    g = torch.Generator().manual_seed(1)
    ours = [torch.nn.Parameter(torch.randn(64, generator=g)), torch.nn.Parameter(torch.randn(8, 3, generator=g))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = MuonAdamW([{"params": ours, "muon": False}], lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    want = torch.optim.AdamW(ref, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    for _ in range(5):
        for a, b in zip(ours, ref, strict=True):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        want.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _loss(module, batch) -> torch.Tensor:
    logits = module(batch)
    return torch.nn.functional.cross_entropy(logits[0].float().flatten(0, 1), batch["labels"].flatten())


def test_muon_trains_an_eagle3_head_and_its_state_survives_a_round_trip(tiny_llama: Path) -> None:
    module = _eagle3(tiny_llama, freeze=True)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 100, (2, 12), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "taps": torch.randn(2, 12, 3 * 64, generator=g),
             "labels": torch.randint(0, module.spec.draft_to_target.numel(), (2, 12), generator=g)}
    opt = build_optimizer(module, TrainConfig(optimizer="muon", lr=2e-2))
    losses = []
    for _ in range(12):
        loss = _loss(module, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0] and all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())  # as a checkpoint holds it (state_dict() shares the tensors)
    assert any("momentum" in st for st in state["state"].values())
    twin = _eagle3(tiny_llama, freeze=True)
    twin.load_state_dict(saved)
    twin_opt = build_optimizer(twin, TrainConfig(optimizer="muon", lr=2e-2))
    twin_opt.load_state_dict(state)
    for m, o in ((module, opt), (twin, twin_opt)):
        _loss(m, batch).backward()
        o.step()
    for (name, a), b in zip(module.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), (name, (a - b).abs().max())


def test_a_muon_run_trains_checkpoints_and_resumes(tmp_path: Path, tiny_llama: Path) -> None:
    from speculators.train.train import run

    write_rows(tmp_path / "rows.jsonl", 12)
    data = recipe_dict(tmp_path / "run", tiny_llama, tmp_path / "rows.jsonl", train={"optimizer": "muon"})
    prepare(data)
    first = run(load(data))
    assert first["steps"] == 6 and math.isfinite(first["final_loss"])
    state = tmp_path / "run" / "checkpoints" / "step-0000006" / "training_state" / "optimizer.bin"
    saved = torch.load(state, weights_only=False)  # accelerate's optimizer state: Muon's momentum buffers in it
    assert any("momentum" in st for st in saved["state"].values())
    data["train"].update(max_steps=9, resume=str(state.parent.parent))  # continue with a longer schedule
    again = run(load(data))
    assert again["resumed_from_step"] == 6 and again["steps"] == 9


@pytest.mark.parametrize("named", ["repo", "renamed"])
def test_muon_under_deepspeed_is_refused_before_anything_is_written(tmp_path: Path, tiny_llama: Path,
                                                                    named: str) -> None:
    """Refused from the accelerate config's parsed distributed_type, whatever the file is called."""
    from speculators.train.train import run

    config = Path("recipes/accelerate/deepspeed-zero2.yaml")
    if named == "renamed":  # a DeepSpeed config whose name does not say so
        text = config.read_text().replace("recipes/deepspeed/zero2.json", str(Path("recipes/deepspeed/zero2.json")
                                                                               .resolve()))
        config = tmp_path / "cluster.yaml"
        config.write_text(text)
    write_rows(tmp_path / "rows.jsonl", 12)
    data = recipe_dict(tmp_path / "run", tiny_llama, tmp_path / "rows.jsonl",
                       train={"optimizer": "muon", "accelerate_config": str(config)})
    prepare(data)
    kept = tmp_path / "run" / "checkpoints" / "keep.txt"
    kept.parent.mkdir(parents=True)
    kept.write_text("an earlier run")
    with pytest.raises(SpeculatorsError, match="not supported with DeepSpeed"):
        run(load(data), force=True)
    assert kept.read_text() == "an earlier run"


def test_deepspeed_refusal_follows_the_launch_not_a_file_name(monkeypatch: pytest.MonkeyPatch) -> None:
    t = TrainConfig(optimizer="muon", accelerate_config="my-deepspeed-free-ddp.yaml")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    check_optimizer_options(t)  # a name proves nothing
    check_optimizer_options(t, deepspeed=False)
    with pytest.raises(SpeculatorsError, match="not supported with DeepSpeed"):
        check_optimizer_options(t, deepspeed=True)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what accelerate launch sets in every worker
    with pytest.raises(SpeculatorsError, match="not supported with DeepSpeed"):
        check_optimizer_options(t)
    check_optimizer_options(TrainConfig(optimizer="adamw"))
