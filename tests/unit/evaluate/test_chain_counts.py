"""Chain speculation counted as vLLM counts it (metrics.ChainCounts / walk_chain), vLLM's /metrics parsed, and the
vLLM section of eval/report.md replaced rather than duplicated."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculators.evaluate.report import VLLM_SECTION_HEADING, with_vllm_section
from speculators.export.vllm_consumer import _COUNTER, counts_between, last_error_line, parse_spec_counters
from speculators.metrics import ChainCounts, walk_chain


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
