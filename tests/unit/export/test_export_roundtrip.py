"""Round trip: the export reloads with load_speculator (after dtype rounding) and drafts exactly like the trained
speculator; the bundled runtime serves it; its pairing refuses other targets and tokenizers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluate"))
from evalexport_helpers import build_speculator, make_recipe, make_run, save_checkpoint  # noqa: E402

from speculators.core.errors import PairingError  # noqa: E402
from speculators.core.pairing import check_pairing, read_pairing  # noqa: E402
from speculators.core.target import fingerprint_target, load_target  # noqa: E402
from speculators.export import export as export_stage  # noqa: E402
from speculators.export import vllm  # noqa: E402
from speculators.models.io import load_speculator, target_weights  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize("family,dtype", [("eagle3", "bfloat16"), ("medusa", "bfloat16"), ("mtp", "float16"),
                                          ("eagle3", "float32"), ("dflash", "bfloat16")])
def test_export_reloads_with_identical_drafts(tmp_path: Path, tiny_llama: Path, family: str, dtype: str) -> None:
    recipe = make_run(tmp_path, tiny_llama, family, steps=(10,), num_steps=2,
                      draft_vocab_size=512 if family == "eagle3" else None,
                      extra=("export.checkpoint=latest", f"export.dtype={dtype}"))
    export_stage.run(recipe)
    out = recipe.paths.export
    loaded = load_target(recipe.target)
    w = target_weights(loaded.model)
    original = load_speculator(recipe.paths.checkpoints / "step-0000010", w).float()
    exported = load_file(str(out / "model.safetensors"))
    want = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    assert {t.dtype for t in exported.values() if t.is_floating_point()} == {want}
    assert vllm.round_trip(out, original, exported, w, vllm.probe_features(loaded.model, original)) == []
    reloaded = load_speculator(out, w).float()
    batch = vllm.probe_features(loaded.model, original, length=16, seed=3)
    assert torch.equal(vllm.greedy_drafts(reloaded, batch),
                       vllm.greedy_drafts(original.to(want).float(), batch))


def test_round_trip_catches_a_tampered_export(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = make_run(tmp_path, tiny_llama, "eagle3", steps=(10,), num_steps=2, extra=("export.checkpoint=latest",))
    export_stage.run(recipe)
    out = recipe.paths.export
    loaded = load_target(recipe.target)
    w = target_weights(loaded.model)
    original = load_speculator(recipe.paths.checkpoints / "step-0000010", w).float()
    state = load_file(str(out / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"] * 3
    save_file(state, str(out / "model.safetensors"))
    problems = vllm.round_trip(out, original, state, w, vllm.probe_features(loaded.model, original))
    assert any("fc.weight differs" in p for p in problems)
    assert any("drafts differently" in p for p in problems)


@pytest.mark.parametrize("changed", [False, True])
def test_eagle3_export_always_carries_its_embedding(tmp_path: Path, tiny_llama: Path, changed: bool) -> None:
    """vLLM's speculators library drafts with an all-zero embedding when the file has none, so the EAGLE-3 export
    holds embed_tokens whether or not it still equals the target's (training checkpoints leave an unchanged one
    out)."""
    recipe = make_recipe(tmp_path, tiny_llama, "eagle3", extra=("export.checkpoint=latest",))
    loaded = load_target(recipe.target)
    fp = fingerprint_target(recipe.target, tokenizer=loaded.tokenizer, model_config=loaded.model.config).to_dict()
    spec = build_speculator(recipe, loaded)
    if changed:
        with torch.no_grad():
            spec.embed_tokens.weight.mul_(2.0)  # no longer the target's embedding
    save_checkpoint(recipe, spec, 10, fp)
    ckpt_names = set(load_file(str(recipe.paths.checkpoints / "step-0000010" / "model.safetensors")))
    assert ("embed_tokens.weight" in ckpt_names) == changed
    export_stage.run(recipe)
    names = load_file(str(recipe.paths.export / "model.safetensors"))
    w = target_weights(loaded.model)
    want = spec.embed_tokens.weight if changed else w.embed_tokens
    assert torch.equal(names["embed_tokens.weight"], want.to(torch.bfloat16))
    cfg = json.loads((recipe.paths.export / "config.json").read_text())
    assert cfg["speculators_native"]["target_tensors"]["embed_tokens.weight"]["saved"] is True


def test_full_vocab_export_has_no_vocab_map_and_reloads(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = make_run(tmp_path, tiny_llama, "eagle3", steps=(10,), num_steps=2, extra=("export.checkpoint=latest",))
    export_stage.run(recipe)
    out = recipe.paths.export
    assert not set(load_file(str(out / "model.safetensors"))) & {"d2t", "t2d"}
    reloaded = load_speculator(out, target_weights(load_target(recipe.target).model))
    assert torch.equal(reloaded.draft_to_target, torch.arange(8192)) and bool(reloaded.t2d.all())


def test_bundled_runtime_serves_the_export(tmp_path: Path, tiny_llama: Path) -> None:
    from speculators.serving import Engine, SamplingParams

    recipe = make_run(tmp_path, tiny_llama, "eagle3", steps=(10,), num_steps=2, extra=("export.checkpoint=latest",))
    export_stage.run(recipe)
    loaded = load_target(recipe.target)
    engine = Engine.from_pretrained(target=loaded, speculator=str(recipe.paths.export))
    plain = Engine.from_pretrained(target=loaded, speculator=None)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    out = engine.generate("def add(a, b):", params)
    assert out.stats.target_calls >= 1 and len(out.token_ids) >= 1
    assert out.token_ids == plain.generate("def add(a, b):", params).token_ids  # lossless at T=0


def _other_tokenizer_target(path: Path) -> Path:
    """A tiny Llama with the house tokenizer plus one extra token (so: another tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.conftest import HOUSE_TARGET, tiny_config

    tok = AutoTokenizer.from_pretrained(HOUSE_TARGET)
    tok.add_tokens(["<|extra-token|>"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tok)))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_pairing_refuses_another_target_and_another_tokenizer(tmp_path: Path, tiny_llama: Path,
                                                              tiny_qwen3: Path) -> None:
    recipe = make_run(tmp_path, tiny_llama, "medusa", steps=(10,), num_steps=2, extra=("export.checkpoint=latest",))
    export_stage.run(recipe)
    out = recipe.paths.export
    record = read_pairing(out)
    assert record["draft"]["family"] == "medusa" and record["export"]["kind"] == "medusa"
    assert record["export"]["source_checkpoint"].endswith("step-0000010")
    same = fingerprint_target(recipe.target).to_dict()
    assert check_pairing(record, same, check_draft_dir=out) == []
    other = fingerprint_target(make_recipe(tmp_path, tiny_qwen3, "medusa").target).to_dict()
    with pytest.raises(PairingError, match="target revision mismatch: the speculator was trained for"):
        check_pairing(record, other)
    foreign = _other_tokenizer_target(tmp_path / "foreign")
    other_tok = fingerprint_target(make_recipe(tmp_path, foreign, "medusa").target).to_dict()
    with pytest.raises(PairingError, match="tokenizer mismatch"):
        check_pairing(record, other_tok, allow_revision_mismatch=True)
    from speculators.serving import Engine

    with pytest.raises(PairingError, match="tokenizer mismatch"):
        Engine.from_pretrained(target=str(foreign), speculator=str(out), device="cpu", dtype="float32")
