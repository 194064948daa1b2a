"""Chain speculation counted as vLLM counts it (metrics.ChainCounts / walk_chain, and the replay's expected counts
that predict vLLM at T > 0), vLLM's /metrics parsed, and the vLLM section of eval/report.md replaced rather than
duplicated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculators.core.metrics import ChainCounts, walk_chain
from speculators.core.vllm_env import last_error_line
from speculators.evaluate.chain_prediction import as_chain_counts, sampled_agreement
from speculators.evaluate.replay import replay_chain
from speculators.evaluate.report import VLLM_SECTION_HEADING, with_vllm_section
from speculators.export.vllm_consumer import _COUNTER, counts_between, parse_spec_counters


def test_walk_visits_the_positions_an_engine_visits() -> None:
    # output token 0 comes from the prefill; from root i the chain accepts reach[i] and commits reach[i] + 1
    reach = [3, 0, 0, 0, 1, 0, 0, 2, 0, 0, 0]
    c = walk_chain(reach, k=3, total=9)  # roots 0 (+4) -> 4 (+2) -> 6 (+1) -> 7 (+3): 11 >= 9 committed
    assert (c.drafts, c.draft_tokens, c.accepted) == (4, 12, [3, 2, 1])
    assert c.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert c.reach == pytest.approx([0.75, 0.5, 0.25])
    assert c.per_position_acceptance == pytest.approx([0.75, 2 / 3, 0.5])
    # the last step is counted in full even past the end (vLLM truncates after counting)
    assert walk_chain([3, 3, 3, 3], k=3, total=2).accepted == [1, 1, 1]
    assert walk_chain([0] * 8, k=2, total=1).drafts == 0  # one token: the prefill's, no verification step
    with pytest.raises(ValueError, match="reach covers"):
        walk_chain([0, 0], k=2, total=5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_as_vllm_counts_what_walk_chain_counts(seed: int) -> None:
    """With 0/1 weights (T = 0, or one sample path) the replay's vLLM counting is the engine walk itself: first step
    from the prefill's token, every step judging all k drafts, none once max_new_tokens are out."""
    gen = torch.Generator().manual_seed(seed)
    k, prompt_len, max_new = 3, 5, 20
    total_len = prompt_len + max_new + k  # the continuation runs k past the cap, as predict_sampled_rows makes it
    w = (torch.rand(total_len - prompt_len, k, generator=gen) < 0.7).double()  # [N, k] rows t = P-2 .. T-3
    reach = [0] * max_new  # from output index i (root x[P+i] = row i+1): leading accepted drafts
    for i in range(max_new):
        while reach[i] < k and w[i + 1, reach[i]] > 0:
            reach[i] += 1
    want = walk_chain(reach, k, max_new)
    got = as_chain_counts(replay_chain(w, prompt_len, total_len, max_new, k, as_vllm=True), k)
    assert got.drafts == want.drafts and got.accepted == [float(a) for a in want.accepted]
    runtime = replay_chain(w, prompt_len, total_len, max_new, k)  # the runtime's own walk differs
    assert (runtime.attempts[0], runtime.accepts) != (got.drafts, got.accepted)


def _sampled_rows(gen: torch.Generator, rates: torch.Tensor, k: int, steps: int) -> list[ChainCounts]:
    """One chain-k row per rate: `steps` drafts whose drafts are accepted independently with the row's rate."""
    rows = []
    for rate in rates.tolist():
        c = ChainCounts(k)
        for _ in range(steps):
            n = 0
            while n < k and torch.rand(1, generator=gen).item() < rate:
                n += 1
            c.record(n, k)
        rows.append(c)
    return rows


def test_sampled_agreement_is_calibrated_over_rows() -> None:
    """Rows differ (each its own acceptance rate, as sampled paths do): two measurements of the same rows agree
    about 95% of the time, and a 25% lower acceptance on every row is caught."""
    gen = torch.Generator().manual_seed(0)
    agree, caught = 0, 0
    for _ in range(100):
        rates = torch.rand(24, generator=gen) * 0.8  # [24] per-row acceptance
        a, b = _sampled_rows(gen, rates, 3, 25), _sampled_rows(gen, rates, 3, 25)
        agree += sampled_agreement(a, b)["agrees"]
        caught += not sampled_agreement(a, _sampled_rows(gen, rates * 0.75, 3, 25))["agrees"]
    assert 85 <= agree <= 100 and caught >= 70, (agree, caught)
    same = sampled_agreement(a, a)
    assert same["delta"] == 0 and same["agrees"] and same["rows"] == 24
    with pytest.raises(ValueError, match="same >= 2 rows"):
        sampled_agreement(a, a[:5])


def test_walk_caps_reach_at_k_and_counts_merge() -> None:
    a = walk_chain([5, 5, 5, 5, 5, 5, 5], k=2, total=7)  # reach beyond k counts as k: 1 -> 4 -> 7
    assert a.accepted == [2, 2] and a.drafts == 2
    b = ChainCounts(k=2)
    b.record(0, 2)
    a.merge(b)
    assert (a.drafts, a.accepted) == (3, [2, 2])
    with pytest.raises(ValueError):
        a.merge(ChainCounts(k=3))
    with pytest.raises(ValueError):
        b.record(3, 2)


METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="m",position="2"} 1.7e+09
"""


def test_vllm_counters_are_parsed_and_differenced() -> None:
    after = parse_spec_counters(METRICS)
    assert after["drafts"] == 10 and after["accepted_per_pos"] == {0: 7.0, 1: 4.0, 2: 1.0}
    before = {"drafts": 4.0, "draft_tokens": 12.0, "accepted_tokens": 5.0, "accepted_per_pos": {0: 3.0, 1: 2.0}}
    c = counts_between(before, after, 3)
    assert (c.drafts, c.draft_tokens, c.accepted) == (6, 18, [4, 2, 1])
    assert not _COUNTER.match("vllm:spec_decode_num_drafts_created 1.7e9 x")


def test_last_error_line_quotes_vllms_own_error(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("INFO starting\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                   "ValueError: There is no module or parameter named 'draft_id_to_target_id'\nINFO shutting down\n")
    assert last_error_line(log).startswith("ValueError: There is no module or parameter named")
    assert last_error_line(tmp_path / "missing.log") == "no log"
    # the engine core's error is logged by its worker process; the API server's wrapper after it only points at it
    log.write_text("(Worker pid=48) ERROR 12-01 12:34:30 [multiproc_executor.py:953]     raise ValueError(msg)\n"
                   "(Worker pid=48) ERROR 12-01 12:34:30 [multiproc_executor.py:953] ValueError: There is no module or "
                   "parameter named 'draft_id_to_target_id' in Eagle3LlamaForCausalLM.\n"
                   "(EngineCore pid=46) ERROR 12-01 12:34:32 [core.py:1510] Exception: WorkerProc initialization "
                   "failed due to an exception in a background process. See stack trace for root cause.\n"
                   "    raise RuntimeError(\nRuntimeError: Engine core initialization failed. See root cause above. "
                   "Failed core proc(s): {'EngineCore': 1}\n")
    assert last_error_line(log).startswith("ValueError: There is no module or parameter named 'draft_id_to_target_id'")
    log.write_text("WARNING ulimit: can cause `OSError: [Errno 24] Too many open files`\nINFO ...\n")  # no exception
    assert last_error_line(log).startswith("WARNING ulimit")


def test_vllm_section_replaces_an_older_copy(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "report.md").write_text(f"{VLLM_SECTION_HEADING}\n\nnew numbers\n")
    old = f"# Evaluation overview\n\ntable\n\n{VLLM_SECTION_HEADING}\n\nold numbers\n"
    text = with_vllm_section(old, tmp_path)
    assert text.count(VLLM_SECTION_HEADING) == 1 and "new numbers" in text and "old numbers" not in text
    assert with_vllm_section(text, tmp_path) == text
    assert with_vllm_section("# Evaluation overview\n", tmp_path / "none") == "# Evaluation overview\n"
