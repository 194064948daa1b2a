"""Medusa (vLLM 0.32's Medusa method: k fixed to num_heads, never a schedule with k = 0) and vLLM's own n-gram
drafter, the baseline (the session's `house_ngram_server`, which test_vllm_regenerate.py shares), on the same rows:
lossless against vLLM alone. The Medusa heads are fitted to the target's
greedy continuations of two of the four rows (tests/vllm/fitting.py; the other two held out), and vLLM's per-row
acceptance counters must equal the offline prediction, position by position: T = 0 identity holds for any draft, so
only the counters show a head-order or offset bug."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculators.export.vllm_check import serve_rows
from speculators.export.vllm_consumer import complete_ids, counts_between, served_model, spec_counters
from tests.conftest import HOUSE_TARGET
from tests.vllm.fitting import fitted_export
from tests.vllm.fixtures import NGRAM_K
from tests.vllm.test_vllm_eagle3 import _rows_and_reference, assert_served_as_predicted, served_rows

pytestmark = pytest.mark.vllm


def test_medusa_export_serves_losslessly_with_the_predicted_acceptance(house_eagle3_run: Path, vllm_server,
                                                                       tmp_path: Path) -> None:
    rows, prompts, reference = served_rows(house_eagle3_run, 4)
    export, predicted = fitted_export(tmp_path / "run", HOUSE_TARGET, "medusa", rows, 2, k=3, lr=3e-3)
    with vllm_server(["bash", str(export / "launch.sh")], "medusa") as server:
        outs, served, _ = serve_rows(server, rows, prompts, 3, counted=True)  # one request at a time, counted
    assert outs == reference
    assert all(c.drafts > 0 and c.draft_tokens == 3 * c.drafts for c in served)  # one token per head, every step
    assert_served_as_predicted("medusa", served, predicted, reference, 3)


def test_vllm_ngram_baseline(house_eagle3_run: Path, house_ngram_server) -> None:
    """vLLM's prompt-lookup drafter (k = 3) on the same rows: lossless, and on copy-heavy rows it accepts drafts."""
    prompts, lengths, reference = _rows_and_reference(house_eagle3_run, 6)
    server = house_ngram_server
    model = served_model(server.url)
    before = spec_counters(server.url)
    assert [complete_ids(server.url, model, p, n) for p, n in zip(prompts, lengths, strict=True)] == reference
    moved = counts_between(before, spec_counters(server.url), NGRAM_K)
    assert moved.drafts > 0 and sum(moved.accepted) > 0, moved.to_dict()
