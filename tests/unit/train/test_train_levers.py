"""Issue 46 on tiny models: the learning curve every training run writes (json fields, PNG, tracker records,
summary share), its sizing rule, and `train.precision=bf16` on the CPU (bf16 autocast in the forward, fp32 weights,
loss and optimizer states, a loss close to fp32's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculators.core.config import Recipe
from speculators.evaluate.replay import replay_chain
from speculators.train.learning_curve import (
    CURVE_FILE,
    ROW_COST,
    _replay_rows,
    curve_steps,
    evenly_spaced_rows,
    open_curve,
    slice_size,
)
from tests.unit.train.train_helpers import load, prepare, recipe_dict, write_rows


@pytest.fixture()
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_curve_steps_and_slice_sizing() -> None:
    assert curve_steps(426, 5) == [0, 106, 213, 320, 426]
    assert curve_steps(3, 10) == [0, 1, 2, 3]
    assert curve_steps(10, 0) == []
    rows, points = slice_size(n_val=90, total_steps=426, rows_per_step=8, points=20, share=0.05)
    assert points == 20 and rows * points * ROW_COST <= 0.05 * 426 * 8
    rows, points = slice_size(n_val=5, total_steps=6, rows_per_step=4, points=20, share=0.05)
    assert rows == 5 and points == 2  # a tiny run: the whole small split, start and end only
    assert evenly_spaced_rows(list(range(100, 110)), 3) == [100, 103, 106]


def test_cycles_are_replayed_per_assistant_span() -> None:
    """A span of assistant tokens a..e-1 is a generation of prompt length a: its roots t = a-2..e-3 are the positions
    where step 0 counts; two spans of one row are two generations (evaluate's replay_chain on each)."""
    depth, t = 3, 30
    g = torch.Generator().manual_seed(0)
    w = (torch.rand(1, t, depth, generator=g) > 0.3).double()  # [B, T, D]
    valid0 = torch.zeros(1, t, dtype=torch.bool)
    valid0[0, 3:13] = True  # assistant tokens 5..14
    valid0[0, 18:27] = True  # assistant tokens 20..28
    got = _replay_rows(w, valid0, depth)
    want = replay_chain(w[0, 3:13], 5, 15, 11, depth)
    want.merge(replay_chain(w[0, 18:27], 20, 29, 10, depth))
    assert got.to_dict() == want.to_dict() and got.calls > 2
    ones = _replay_rows(torch.ones(1, t, depth, dtype=torch.float64), valid0, depth)
    assert ones.per_position() == [1.0, 1.0, 1.0] and ones.tau > 3.0  # every draft accepted: ~depth + 1 a call


def test_a_resumed_run_keeps_the_points_it_continues(tmp_path: Path) -> None:
    from types import SimpleNamespace

    recipe = Recipe(run_dir=str(tmp_path))
    setup = SimpleNamespace(val_idx=list(range(40)), store=None,
                            source=SimpleNamespace(row_ids=lambda: [f"r{i}" for i in range(40)]))
    (tmp_path / "checkpoints").mkdir()
    old = [{"step": s, "train_seconds": 10.0 * s, "train_cpu_seconds": 15.0 * s, "tokens": 100 * s}
           for s in (0, 5, 10, 15)]
    (tmp_path / "checkpoints" / CURVE_FILE).write_text(json.dumps({"points": old}))
    curve = open_curve(recipe, setup, 5, 20, 12, tracker=None, world=1)
    assert [p["step"] for p in curve.points] == [0, 5, 10] and curve.seconds_before == 100.0
    assert curve.cpu_seconds_before == 150.0
    fresh = open_curve(recipe, setup, 5, 20, 0, tracker=None, world=1)
    assert fresh.points == [] and fresh.seconds_before == 0.0 and 0 in fresh.steps and 20 in fresh.steps
    assert fresh.meta["slice"]["regenerated_at"] == ["the dataset's own answers"]


def test_a_training_run_writes_its_learning_curve(tmp_path: Path, tiny_llama: Path, one_thread) -> None:
    from speculators.train.train import run

    write_rows(tmp_path / "rows.jsonl", 24)
    data = recipe_dict(tmp_path / "run", tiny_llama, tmp_path / "rows.jsonl",
                       train={"max_steps": 6, "curve_points": 4, "curve_rows": 4, "trackers": ["jsonl", "tensorboard"]})
    prepare(data)
    summary = run(load(data))
    ckpts = tmp_path / "run" / "checkpoints"
    curve = json.loads((ckpts / "learning-curve.json").read_text())
    assert curve["format"] == "speculators.learning-curve/v1" and curve["temperatures"] == [0.0, 1.0]
    assert curve["slice"]["rows"] == min(4, curve["slice"]["held_out_rows"]) >= 3 and curve["depth"] == 2
    steps = [p["step"] for p in curve["points"]]
    assert steps == [0, 2, 4, 6]
    for p in curve["points"]:
        assert {"train_seconds", "train_cpu_seconds", "tokens", "tau_cycle_starts_t0", "tau_cycle_starts_t1", "per_position_t0",
                "per_position_t1", "eval_seconds"} <= p.keys()
        assert 1.0 <= p["tau_cycle_starts_t0"] <= 3.0 and 1.0 <= p["tau_cycle_starts_t1"] <= 3.0
    assert curve["points"][0]["tokens"] == 0 and curve["points"][0]["train_seconds"] == 0.0
    assert all(a["tokens"] < b["tokens"] and a["train_seconds"] < b["train_seconds"]
               and a["train_cpu_seconds"] < b["train_cpu_seconds"]
               for a, b in zip(curve["points"], curve["points"][1:], strict=False))
    assert (ckpts / "learning-curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["curve_points"] == 4 and summary["learning_curve"] == str(ckpts / "learning-curve.json")
    share = summary["curve_share_of_training"]
    assert share > 0 and share == curve["share_of_training_this_run"]
    assert curve["eval_seconds_this_run"] > 0  # (no wall-clock ratio checked: timings move with the machine's load)
    assert summary["curve_tau_cycle_starts_t0"] == curve["points"][-1]["tau_cycle_starts_t0"]
    written = json.loads((ckpts / "train-summary.json").read_text())
    assert written["curve_rows"] == curve["slice"]["rows"] and "validation_seconds" in written
    records = [json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r["kind"] == "curve"]
    assert [r["step"] for r in logged] == steps and "tau_cycle_starts_t1" in logged[-1]
    assert list((tmp_path / "run" / "logs" / "tensorboard").rglob("events.*"))


def _bf16_rig(tiny_llama: Path, precision: str):
    from transformers import AutoModelForCausalLM

    from speculators.core.config import Recipe, SpeculatorConfig
    from speculators.models import SPECULATORS
    from speculators.models.io import target_weights
    from speculators.train.accelerator import make_accelerator, train_module_class

    target = AutoModelForCausalLM.from_pretrained(tiny_llama)
    torch.manual_seed(0)
    spec = SPECULATORS["eagle3"].from_target(target.config, SpeculatorConfig(num_steps=2), target_weights(target))
    recipe = Recipe()
    recipe.target.device = "cpu"
    recipe.train.precision = precision
    acc = make_accelerator(recipe)
    module = train_module_class()(spec)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    model, opt = acc.prepare(module, opt)
    return acc, model, opt, spec, target


def _one_step(acc, model, opt, spec, target) -> tuple[float, list]:
    from speculators.models.base import step_rows
    from speculators.train.loss import VocabMap, dense_teacher, speculator_loss

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 200, (2, 12), generator=g)
    am, lm = torch.ones_like(ids), torch.ones_like(ids)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i] for i in spec.layer_ids], dim=-1)  # [B, T, 3H]
    vocab = VocabMap.build(spec.draft_to_target, target.config.vocab_size)
    rows = step_rows(lm, am, spec.num_steps)
    dtypes: list = []
    hook = spec.lm_head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    logits = model({"input_ids": ids, "attention_mask": am, "taps": taps, "head_rows": rows})
    hook.remove()
    loss = speculator_loss(logits, dense_teacher(out.logits, vocab), lm, am, [1.0, 0.8], vocab, rows=rows).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return float(loss.detach()), dtypes + [loss.dtype]


def test_bf16_on_cpu_trains_with_fp32_weights_and_states_close_to_fp32(tiny_llama: Path, one_thread) -> None:
    acc, model, opt, spec, target = _bf16_rig(tiny_llama, "fp32")
    ref, ref_dtypes = _one_step(acc, model, opt, spec, target)
    acc, model, opt, spec, target = _bf16_rig(tiny_llama, "bf16")
    assert acc.mixed_precision == "bf16" and acc.device.type == "cpu"
    loss, dtypes = _one_step(acc, model, opt, spec, target)
    assert ref_dtypes == [torch.float32, torch.float32, torch.float32]
    assert dtypes[:2] == [torch.bfloat16, torch.bfloat16]  # the head ran under CPU autocast
    assert dtypes[2] == torch.float32  # the loss is fp32
    assert torch.isfinite(torch.tensor(loss)) and loss == pytest.approx(ref, rel=0.03)
    assert all(p.dtype == torch.float32 for p in spec.parameters())
    states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    assert states and all(v.dtype == torch.float32 for v in states)


def test_eagle3_levers_for_other_families_and_bad_curve_settings_are_refused(tmp_path: Path, tiny_llama: Path) -> None:
    from speculators.core.errors import SpeculatorsError
    from speculators.train.train import run

    write_rows(tmp_path / "rows.jsonl", 12)
    data = recipe_dict(tmp_path / "run", tiny_llama, tmp_path / "rows.jsonl",
                       speculator={"family": "medusa", "draft_vocab_size": None, "freeze_lm_head": True})
    prepare(data)
    with pytest.raises(SpeculatorsError, match="freeze_lm_head is an eagle3 option"):
        run(load(data))
    data["speculator"] = {"family": "eagle3", "num_steps": 2, "draft_vocab_size": 512}
    data["train"]["curve_share"] = 0.0
    with pytest.raises(SpeculatorsError, match="train.curve_share in"):
        run(load(data))
    assert not (tmp_path / "run" / "checkpoints").exists()
