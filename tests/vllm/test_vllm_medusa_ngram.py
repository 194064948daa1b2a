"""Medusa (vLLM 0.32's Medusa method: k fixed to num_heads, never a schedule with k = 0) and vLLM's own n-gram
drafter, the baseline, on the same rows: lossless against vLLM alone and acceptance counters that move."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculators.export.vllm_consumer import complete_ids, counts_between, served_model, spec_counters
from tests.conftest import HOUSE_TARGET
from tests.vllm.test_vllm_eagle3 import _rows_and_reference

pytestmark = pytest.mark.vllm


def test_medusa_export_serves_losslessly(house_eagle3_run: Path, export_of, vllm_server) -> None:
    export = export_of("medusa", None, 3)
    prompts, lengths, reference = _rows_and_reference(house_eagle3_run, 3)
    with vllm_server(["bash", str(export / "launch.sh")], "medusa") as server:
        model = served_model(server.url)
        before = spec_counters(server.url)
        assert [complete_ids(server.url, model, p, n) for p, n in zip(prompts, lengths, strict=True)] == reference
        moved = counts_between(before, spec_counters(server.url), 3)
    assert moved.drafts > 0 and moved.draft_tokens == 3 * moved.drafts  # one token per head, every step


@pytest.mark.parametrize("k", [3])
def test_vllm_ngram_baseline(house_eagle3_run: Path, vllm_server, k: int) -> None:
    """vLLM's prompt-lookup drafter on the same rows: lossless, and on copy-heavy rows it accepts drafts."""
    prompts, lengths, reference = _rows_and_reference(house_eagle3_run, 6)
    config = json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                         "prompt_lookup_min": 2})
    with vllm_server(["python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(HOUSE_TARGET),
                      "--speculative-config", config], "ngram") as server:
        model = served_model(server.url)
        before = spec_counters(server.url)
        assert [complete_ids(server.url, model, p, n) for p, n in zip(prompts, lengths, strict=True)] == reference
        moved = counts_between(before, spec_counters(server.url), k)
    assert moved.drafts > 0 and sum(moved.accepted) > 0, moved.to_dict()
