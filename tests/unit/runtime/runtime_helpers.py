"""Helpers for the runtime tests: HF reference decoding, random speculator directories with pairing.json.

Imported as `tests.unit.runtime.runtime_helpers` (the repo root is on pytest's pythonpath) by unit and
integration tests alike.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from speculators.core.trees import ancestor_mask, depths_of

FAMILIES = ("eagle3", "medusa", "mtp", "dflash")


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    """The target loaded by Hugging Face (fp32, eval), cached per path."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@functools.lru_cache(maxsize=8)
def loaded_target(path: str):
    """`speculators.core.target.load_target` of `path` on CPU fp32, cached per path (engines share it)."""
    from speculators.core.config import TargetConfig
    from speculators.core.target import load_target

    return load_target(TargetConfig(name_or_path=str(path), device="cpu", dtype="float32"))


def hf_greedy(path: str | Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face `generate(do_sample=False)` continuation (generated ids only, EOS included)."""
    model = hf_model(str(path))
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=model.generation_config.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


def hf_greedy_many(path: str | Path, prompts: list[list[int]], max_new: list[int], batch: int = 32) -> list[list[int]]:
    """`hf_greedy` of many prompts, `batch` at a time through one left-padded `generate(do_sample=False)` (each row
    cut at its own `max_new` and after its first EOS, as a single-row call stops there). Padding changes fp32 sums
    in their last bits only: a row whose greedy path differs from a single-row call's can only do so at an exact
    near-tie, which the callers' comparisons allow and count (`top2_margin`, from an unpadded forward)."""
    model = hf_model(str(path))
    pad = model.generation_config.pad_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch: less padding
    out: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch):
        rows = order[start:start + batch]
        group, limits = [prompts[i] for i in rows], [max_new[i] for i in rows]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])  # [B, W], left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])  # [B, W]
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(limits),
                                 pad_token_id=pad)[:, width:]  # [B, <= max(limits)]
        for i, row, limit in zip(rows, gen.tolist(), limits, strict=True):
            row = row[:limit]
            end = next((k for k, t in enumerate(row) if t in eos), None)
            out[i] = row if end is None else row[:end + 1]
    return out


def top2_margin(path: str | Path, ids: list[int]) -> float:
    """logit(top-1) - logit(top-2) of the target's next-token logits after `ids` (HF forward)."""
    with torch.no_grad():
        logits = hf_model(str(path))(torch.tensor([ids])).logits[0, -1]
    top = torch.topk(logits.double(), 2).values
    return float(top[0] - top[1])


def make_speculator_dir(target_dir: str | Path, family: str, out: str | Path, *, seed: int = 0,
                        num_steps: int = 3, scale: float = 0.02) -> Path:
    """A randomly initialised speculator of `family` for the target in `target_dir`, saved with its
    pairing.json to `out` (a real checkpoint dir, as training writes it)."""
    from speculators.core.config import SpeculatorConfig, TargetConfig
    from speculators.core.pairing import pairing_record, write_pairing
    from speculators.core.target import fingerprint_target
    from speculators.models import SPECULATORS
    from speculators.models.io import save_speculator, target_weights

    model = hf_model(str(target_dir))
    spec_cfg = SpeculatorConfig(family=family, num_steps=num_steps)
    torch.manual_seed(seed)
    spec = SPECULATORS[family].from_target(model.config, spec_cfg, target_weights(model))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in spec.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    out = Path(out)
    save_speculator(spec, out, {"family": family})
    fp = fingerprint_target(TargetConfig(name_or_path=str(target_dir))).to_dict()
    taps = spec.required_features().tap_layer_ids
    write_pairing(out, pairing_record(target=fp, family=family, layer_ids=list(taps) if taps else None,
                                      draft_dir=out))
    return out


def check_runner_against_hf(runner, model: torch.nn.Module, taps: tuple[int, ...], atol: float = 1e-4) -> None:
    """`runner` (built on `model` with `taps` and the last hidden state requested) gives the HF forward's logits,
    taps and last hidden state over a prompt chunk, a tree with decoys after a KV commit, a chain after a gathered
    commit and a single token (20 random tokens; fp32)."""
    vocab = int(model.config.get_text_config().vocab_size)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (20,), generator=g)
    with torch.no_grad():
        ref = model(ids[None], output_hidden_states=True)
    logits, hidden = ref.logits[0], ref.hidden_states  # [20, V]; hidden[k] enters layer k
    cache = runner.new_cache(64)
    # prompt chunk from slot 0
    out = runner.forward(cache, ids[:10])
    torch.testing.assert_close(out.logits, logits[:10], atol=atol, rtol=0)
    torch.testing.assert_close(out.features["taps"], torch.cat([hidden[t][0, :10] for t in taps], -1),
                               atol=atol, rtol=0)
    torch.testing.assert_close(out.features["last_hidden"], hidden[-1][0, :10], atol=atol, rtol=0)
    cache.commit(list(range(10)))
    # a tree rooted at ids[10]: path 0 -> 1 -> 3 -> 4 carries ids[10..13]; nodes 2, 5 are decoys
    tokens = torch.stack([ids[10], ids[11], torch.tensor(7 % vocab), ids[12], ids[13], torch.tensor(9 % vocab)])
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    tree = runner.forward(cache, tokens, depths_of(parents), ancestor_mask(parents))
    torch.testing.assert_close(tree.logits[[0, 1, 3, 4]], logits[10:14], atol=atol, rtol=0)
    # the output head run later on some rows of `hidden` (what TargetRows does) gives the same logits
    torch.testing.assert_close(runner.logits(tree.hidden[[4, 1]]), tree.logits[[4, 1]], atol=1e-6, rtol=0)
    torch.testing.assert_close(runner.logits(tree.hidden[[3]]), logits[12:13], atol=atol, rtol=0)
    assert runner.logits(tree.hidden[:0]).shape == (0, vocab)
    torch.testing.assert_close(tree.features["taps"][[0, 1, 3, 4]],
                               torch.cat([hidden[t][0, 10:14] for t in taps], -1), atol=atol, rtol=0)
    cache.commit([0, 1, 3, 4])
    assert cache.length == 14
    # a chain after the commit, and a single token: both see exactly the committed path
    chain = runner.forward(cache, ids[14:18])
    torch.testing.assert_close(chain.logits, logits[14:18], atol=atol, rtol=0)
    cache.commit([0, 1, 2, 3])
    one = runner.forward(cache, ids[18:19], logit_rows=torch.tensor([0]))
    torch.testing.assert_close(one.logits, logits[18:19], atol=atol, rtol=0)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine OpenMP threads that wait
    for a busy core slow every small op down by orders of magnitude: run these tests on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
