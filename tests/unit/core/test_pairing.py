"""pairing.json: what the runtime refuses, and what the override allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculators.core.errors import PairingError, SpeculatorsError
from speculators.core.pairing import check_pairing, draft_revision, pairing_record, read_pairing, write_pairing


def _target(**kw) -> dict:
    base = dict(name_or_path="org/model", revision="abc123", content_hash="c" * 64, tokenizer_hash="t" * 64,
                adapter=None, adapter_revision=None, architectures=["LlamaForCausalLM"], num_layers=8,
                hidden_size=256, vocab_size=8192)
    base.update(kw)
    return base


def _draft_dir(tmp_path: Path) -> Path:
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(b"weights")
    return d


def test_roundtrip_and_accept_same_target(tmp_path: Path) -> None:
    d = _draft_dir(tmp_path)
    rec = pairing_record(target=_target(), family="eagle3", layer_ids=[2, 4, 5], draft_dir=d)
    write_pairing(d, rec)
    assert read_pairing(d) == rec
    assert check_pairing(rec, _target(), check_draft_dir=d) == []


def test_revision_mismatch_refused_unless_overridden(tmp_path: Path) -> None:
    rec = pairing_record(target=_target(), family="eagle3", layer_ids=None, draft_dir=_draft_dir(tmp_path))
    other = _target(revision="def456", content_hash="d" * 64)
    with pytest.raises(PairingError, match=r"org/model@abc123.*org/model@def456"):
        check_pairing(rec, other)
    warnings = check_pairing(rec, other, allow_revision_mismatch=True)
    assert warnings and "abc123" in warnings[0]


def test_tokenizer_mismatch_always_refused(tmp_path: Path) -> None:
    rec = pairing_record(target=_target(), family="medusa", layer_ids=None, draft_dir=_draft_dir(tmp_path))
    with pytest.raises(PairingError, match="tokenizer mismatch"):
        check_pairing(rec, _target(tokenizer_hash="x" * 64), allow_revision_mismatch=True)


def test_adapter_is_part_of_the_revision(tmp_path: Path) -> None:
    rec = pairing_record(target=_target(adapter="lora", adapter_revision="local:1"), family="eagle3",
                         layer_ids=None, draft_dir=_draft_dir(tmp_path))
    with pytest.raises(PairingError, match="revision mismatch"):
        check_pairing(rec, _target(adapter="lora", adapter_revision="local:2"))


def test_changed_draft_weights_detected(tmp_path: Path) -> None:
    d = _draft_dir(tmp_path)
    rec = pairing_record(target=_target(), family="eagle3", layer_ids=None, draft_dir=d)
    (d / "model.safetensors").write_bytes(b"other weights")
    assert draft_revision(d) != rec["draft"]["revision"]
    with pytest.raises(PairingError, match="changed since pairing.json"):
        check_pairing(rec, _target(), check_draft_dir=d)


def test_missing_or_bad_pairing_file(tmp_path: Path) -> None:
    with pytest.raises(SpeculatorsError, match="has no pairing.json"):
        read_pairing(tmp_path)
    (tmp_path / "pairing.json").write_text("{")
    with pytest.raises(SpeculatorsError, match="not valid JSON"):
        read_pairing(tmp_path)
