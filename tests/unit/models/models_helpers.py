"""Shared helpers for the speculator model tests: tiny random targets in memory and their features."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from speculators.core.config import SpeculatorConfig
from speculators.core.target import forward_with_taps
from speculators.models import SPECULATORS
from speculators.models.io import target_weights


def _tests_conftest():
    """tests/conftest.py as a module (the one pytest loaded, or loaded here by path)."""
    path = Path(__file__).resolve().parents[2] / "conftest.py"
    mod = sys.modules.get("conftest")
    if mod is not None and Path(getattr(mod, "__file__", "")).resolve() == path:
        return mod
    spec = importlib.util.spec_from_file_location("speculators_tests_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tiny_config = _tests_conftest().tiny_config


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run ~10x faster with one intra-op thread on a busy 2-core machine; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
VOCAB = 300
HIDDEN = 64


def tiny_target(family: str = "llama", seed: int = 0, **overrides):
    """(config, model) of a tiny random target kept in memory (fp32, eval mode, frozen; cached per family/seed)."""
    if not overrides:
        return _cached_target(family, seed)
    return _make_target(family, seed, **overrides)


@functools.lru_cache(maxsize=8)
def _cached_target(family: str, seed: int):
    return _make_target(family, seed)


def _make_target(family: str, seed: int, **overrides):
    cfg = tiny_config(family, VOCAB, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return cfg, model


def build(family: str, target_family: str = "llama", draft_arch: str = "llama", num_steps: int = 3,
          d2t: torch.Tensor | None = None, seed: int = 0, **spec_overrides):
    """(speculator, target config, target model); the speculator's non-frozen weights are randomised so that
    every path through the model matters (Medusa's zero-initialised ResBlocks included)."""
    cfg, target = tiny_target(target_family, seed=seed)
    spec = SpeculatorConfig(family=family, num_steps=num_steps, draft_arch=draft_arch,
                            draft_vocab_size=None if d2t is None else int(d2t.shape[0]), **spec_overrides)
    torch.manual_seed(seed + 1)
    model = SPECULATORS[family].from_target(cfg, spec, target_weights(target), d2t=d2t)
    return model, cfg, target


def randomize(model: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> None:
    """Perturb every trainable parameter (keeps frozen target copies intact)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def target_features(target, input_ids: torch.Tensor, layer_ids: list[int] | None) -> dict[str, torch.Tensor]:
    """'taps' [B, T, n*H] (if layer_ids) and 'last_hidden' [B, T, H] from one forward of the tiny target."""
    out = forward_with_taps(target, input_ids, torch.ones_like(input_ids), layer_ids)
    feats = {"last_hidden": out.last_hidden}
    if layer_ids:
        feats["taps"] = out.taps
    return feats


def reduced_vocab(vocab: int, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random reduced draft vocab: (d2t [size] int64 offsets, sorted target ids [size])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randperm(vocab, generator=g)[:size]).values
    return ids - torch.arange(size), ids
