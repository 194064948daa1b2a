"""The engine refuses a speculator trained for another target (naming both revisions), allows an explicit
revision override but never a tokenizer mismatch, and rejects incomplete checkpoint directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from speculators.core.errors import PairingError, SpeculatorsError
from speculators.runtime.drafters.load import _FINGERPRINTS
from speculators.serving import Engine
from tests.conftest import make_tiny_target
from tests.unit.runtime.runtime_helpers import loaded_target, make_speculator_dir, single_thread  # noqa: F401


@pytest.fixture(scope="module")
def spec_dir(tiny_llama, tmp_path_factory) -> Path:
    return make_speculator_dir(tiny_llama, "medusa", tmp_path_factory.mktemp("pair") / "medusa")


def _edit_pairing(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    record = json.loads((dst / "pairing.json").read_text())
    edit(record)
    (dst / "pairing.json").write_text(json.dumps(record))
    return dst


def test_paired_speculator_loads_and_fingerprint_is_cached(tiny_llama, spec_dir) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), str(spec_dir))
    assert engine.info.family == "medusa" and engine.info.pairing_warnings == []
    assert any(key[0] == str(tiny_llama) for key in _FINGERPRINTS)


def test_other_target_is_refused_naming_both_revisions(tiny_llama, spec_dir, tmp_path) -> None:
    other = make_tiny_target(tmp_path / "other", "llama", seed=7)
    with pytest.raises(PairingError) as err:
        Engine.from_pretrained(loaded_target(str(other)), str(spec_dir))
    msg = str(err.value)
    want = json.loads((spec_dir / "pairing.json").read_text())["target"]["revision"]
    assert "target revision mismatch" in msg and want in msg and "local:" in msg.split("but the target is")[1]
    assert "--allow-revision-mismatch" in msg
    # the explicit override serves it anyway (medusa copies no frozen target tensor), with a warning
    engine = Engine.from_pretrained(loaded_target(str(other)), str(spec_dir), allow_revision_mismatch=True)
    assert len(engine.info.pairing_warnings) == 1 and want in engine.info.pairing_warnings[0]


def test_revision_override_for_same_weights(tiny_llama, spec_dir, tmp_path) -> None:
    rev2 = tmp_path / "rev2"
    shutil.copytree(tiny_llama, rev2)
    config = json.loads((rev2 / "config.json").read_text())
    config["note"] = "same weights, new revision"
    (rev2 / "config.json").write_text(json.dumps(config))
    with pytest.raises(PairingError, match="target revision mismatch"):
        Engine.from_pretrained(loaded_target(str(rev2)), str(spec_dir))
    engine = Engine.from_pretrained(loaded_target(str(rev2)), str(spec_dir), allow_revision_mismatch=True)
    assert len(engine.info.pairing_warnings) == 1 and "allowed by override" in engine.info.pairing_warnings[0]


def test_tokenizer_mismatch_is_always_refused(tiny_llama, spec_dir, tmp_path) -> None:
    bad = _edit_pairing(spec_dir, tmp_path / "tok", lambda r: r["target"].update(tokenizer_hash="0" * 64))
    for override in (False, True):
        with pytest.raises(PairingError, match="tokenizer mismatch"):
            Engine.from_pretrained(loaded_target(str(tiny_llama)), str(bad), allow_revision_mismatch=override)


def test_incomplete_or_inconsistent_directories(tiny_llama, spec_dir, tmp_path) -> None:
    target = loaded_target(str(tiny_llama))
    for missing in ("model.safetensors", "pairing.json", "config.json"):
        d = tmp_path / f"no-{missing}"
        shutil.copytree(spec_dir, d)
        (d / missing).unlink()
        with pytest.raises(SpeculatorsError, match=f"missing {missing}") as err:
            Engine.from_pretrained(target, str(d))
        assert "\n" not in str(err.value)
    with pytest.raises(SpeculatorsError, match="speculator not found"):
        Engine.from_pretrained(target, str(tmp_path / "nowhere"))
    wrong = _edit_pairing(spec_dir, tmp_path / "layers", lambda r: r["draft"].update(layer_ids=[1, 2, 3]))
    eagle = make_speculator_dir(tiny_llama, "eagle3", tmp_path / "eagle3")
    _edit_pairing(eagle, tmp_path / "eagle3-layers", lambda r: r["draft"].update(layer_ids=[1, 2, 3]))
    with pytest.raises(SpeculatorsError, match=r"records layer ids \[1, 2, 3\]"):
        Engine.from_pretrained(target, str(tmp_path / "eagle3-layers"))
    assert Engine.from_pretrained(target, str(wrong)).info.family == "medusa"  # medusa taps no layers


def test_checkpoints_dir_resolves_best(tiny_llama, spec_dir, tmp_path) -> None:
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(spec_dir, ckpts / "step-0000010")
    (ckpts / "best").write_text("step-0000010\n")
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), str(ckpts))
    assert engine.info.directory.endswith("step-0000010")


def test_draft_dtype_auto_is_float16_on_cpu_and_never_touches_the_target(tiny_llama, spec_dir) -> None:
    import torch

    target = loaded_target(str(tiny_llama))
    from speculators.models.packed import PackedLinear, packed_float16_available

    auto = Engine.from_pretrained(target, str(spec_dir), ngram_graft=0)  # the speculator itself as the drafter
    linears = [m for m in auto.drafter.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    if packed_float16_available():  # float16 weights as packed products, float32 activations
        assert all(isinstance(m, PackedLinear) for m in linears)
        assert auto.info.precision == "float16 weights, float32 activations"
        assert all(torch.equal(m.weight, m.weight.half().float()) for m in linears)
    else:
        assert next(auto.drafter.parameters()).dtype == torch.float16
    assert auto.runner.dtype == torch.float32 and target.model.dtype == torch.float32
    exact = Engine.from_pretrained(target, str(spec_dir), draft_dtype="float32", ngram_graft=0)
    assert next(exact.drafter.parameters()).dtype == torch.float32 and exact.info.precision == "float32"
    assert not any(isinstance(m, PackedLinear) for m in exact.drafter.modules())
    with pytest.raises(SpeculatorsError, match="draft dtype must be auto") as err:
        Engine.from_pretrained(target, str(spec_dir), draft_dtype="fp8")
    assert "\n" not in str(err.value)


def _same_size_edit_keeping_mtime(path: Path) -> None:
    """Flip one byte in the middle of a file and put its old mtime back (what `cp -p` or a careful edit does)."""
    import os

    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_draft_edited_after_export_is_refused_at_every_load(tiny_llama, spec_dir, tmp_path) -> None:
    edited = tmp_path / "edited"
    shutil.copytree(spec_dir, edited)
    target = loaded_target(str(tiny_llama))
    assert Engine.from_pretrained(target, str(edited)).info.family == "medusa"
    _same_size_edit_keeping_mtime(edited / "model.safetensors")
    with pytest.raises(PairingError, match="draft weights in .* changed since pairing.json was written"):
        Engine.from_pretrained(target, str(edited))


def test_target_fingerprint_sees_an_edit_that_keeps_size_and_mtime(tmp_path) -> None:
    """Both fingerprint caches (in-process and the on-disk file-hash cache) key on ctime and inode as well."""
    from speculators.runtime.drafters.load import target_fingerprint

    target_dir = make_tiny_target(tmp_path / "t", "llama", seed=3)
    before = target_fingerprint(loaded_target(str(target_dir)))
    _same_size_edit_keeping_mtime(target_dir / "model.safetensors")
    after = target_fingerprint(loaded_target(str(target_dir)))
    assert after["content_hash"] != before["content_hash"] and after["revision"] != before["revision"]


def test_target_defaults_to_the_one_pairing_json_names(tiny_llama, spec_dir) -> None:
    """`--speculator DIR` without `--target` serves the target the speculator was trained for, not the house one."""
    from speculators.runtime.drafters.load import paired_target

    assert paired_target(str(spec_dir)).name_or_path == str(tiny_llama)
    assert paired_target("ngram").name_or_path == "data/targets/stdlib-lm"
    engine = Engine.from_pretrained(None, str(spec_dir), device="cpu", dtype="float32")
    assert engine.target.cfg.name_or_path == str(tiny_llama) and engine.info.family == "medusa"
