"""Several requests behind one step (batching.py): the same outputs as alone, isolation of failures and
cancellations, bad requests refused before anything runs."""

from __future__ import annotations

import pytest

from speculators.core.errors import SpeculatorsError
from speculators.runtime.batching import BatchRunner, generate_batch
from speculators.serving import Engine, SamplingParams
from tests.unit.runtime.runtime_helpers import loaded_target, make_speculator_dir, single_thread  # noqa: F401

PROMPTS = ["def f(x):", "a b c a b c a b", "import os\nimport sys\n", "x = 1\ny = 2\nz =", "class A:\n    def"]


def _params(i: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=6 + 5 * i, **kw)


@pytest.fixture(scope="module")
def spec_dirs(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("batch-specs")
    return {f: str(make_speculator_dir(tiny_llama, f, root / f, seed=3)) for f in ("eagle3", "medusa", "mtp", "dflash")}


@pytest.mark.parametrize("drafter", ["none", "ngram", "eagle3", "medusa", "mtp", "dflash"])
def test_batched_greedy_equals_alone(tiny_llama, spec_dirs, drafter: str) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), spec_dirs.get(drafter, drafter), max_len=128)
    engine.set_tree(engine.tree, adaptive=False)  # drafts every cycle: the controller's choice follows the timing
    stops = [None, None, ["\n"], None, None]
    alone = [engine.generate(p, _params(i, stop=stops[i])) for i, p in enumerate(PROMPTS)]
    runner = BatchRunner(engine, max_batch=3)  # 5 requests, 3 at a time: later ones join as others finish
    chunks: dict[int, list] = {}
    tickets = [runner.add(engine.encode(p), _params(i, stop=stops[i]),
                          emit=lambda item, i=i: chunks.setdefault(i, []).append(item))
               for i, p in enumerate(PROMPTS)]
    runner.run()
    assert runner.largest_batch == 3, "requests never shared a forward: the test would prove nothing"
    for i, (ticket, want) in enumerate(zip(tickets, alone, strict=True)):
        assert ticket.error is None and ticket.done
        assert ticket.output.token_ids == want.token_ids, f"request {i}"
        assert ticket.output.text == want.text and ticket.output.finish_reason == want.finish_reason
        assert chunks[i][-1] is None and chunks[i][-2].output is ticket.output  # the chunks, then the end
        streamed = [t for c in chunks[i][:-1] for t in c.token_ids]
        assert streamed == want.token_ids
    if drafter != "none":
        assert sum(t.output.stats.acceptance.drafted_tokens for t in tickets) > 0


def test_seeded_sampled_batch_repeats_and_generate_batch_keeps_order(tiny_llama, spec_dirs) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), spec_dirs["eagle3"], max_len=128)
    params = [_params(i, temperature=0.9, top_p=0.95, seed=10 + i) for i in range(len(PROMPTS))]
    first = generate_batch(engine, PROMPTS, params, max_batch=4)
    again = generate_batch(engine, PROMPTS, params, max_batch=4)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(o.finish_reason == "stop" or len(o.token_ids) == p.max_new_tokens
               for o, p in zip(first, params, strict=True))
    assert [o.prompt_token_ids for o in first] == [engine.encode(p) for p in PROMPTS]


def test_a_failing_or_cancelled_request_leaves_the_others_alone(tiny_llama, monkeypatch) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", max_len=128)
    alone = [engine.generate(p, _params(3)) for p in PROMPTS[:3]]
    real = engine.request
    bad_prompt = engine.encode(PROMPTS[1])

    def flaky(prompt_ids, *args, **kw):
        inner = real(prompt_ids, *args, **kw)
        reply = None
        cycles = 0
        while True:
            item = inner.send(reply)
            if prompt_ids == bad_prompt and hasattr(item, "token_ids"):
                cycles += 1
                if cycles == 2:
                    raise RuntimeError("drafter exploded")
            reply = yield item

    monkeypatch.setattr(engine, "request", flaky)
    runner = BatchRunner(engine, max_batch=4)
    ends: dict[int, object] = {}
    tickets = [runner.add(engine.encode(p), _params(3), emit=lambda x, i=i: ends.__setitem__(i, x))
               for i, p in enumerate(PROMPTS[:3])]
    cancelled = runner.add(engine.encode(PROMPTS[3]), _params(3), emit=lambda x: ends.__setitem__(3, x))
    runner.step()
    runner.cancel(cancelled)
    runner.run()
    assert isinstance(tickets[1].error, RuntimeError) and isinstance(ends[1], RuntimeError)
    assert tickets[1].output is None
    assert cancelled.done and cancelled.output is None and ends[3] is None
    for i in (0, 2):
        assert tickets[i].error is None and tickets[i].output.token_ids == alone[i].token_ids
    assert not runner.busy and len(runner._free_slots) >= 3  # every slot came back
    # the runner keeps serving afterwards
    again = runner.add(engine.encode(PROMPTS[0]), _params(3))
    runner.run()
    assert again.output.token_ids == alone[0].token_ids


def test_bad_requests_are_refused_before_anything_runs(tiny_llama) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", max_len=64)
    calls_before = engine.totals.target_calls
    with pytest.raises(SpeculatorsError, match="exceed the KV cache"):
        generate_batch(engine, PROMPTS[:2], [_params(0), SamplingParams(max_new_tokens=500)])
    with pytest.raises(SpeculatorsError, match="top_p must be in"):
        generate_batch(engine, PROMPTS[:2], SamplingParams(top_p=0.0))
    with pytest.raises(SpeculatorsError, match="2 prompts but 1 SamplingParams"):
        generate_batch(engine, PROMPTS[:2], [_params(0)])
    with pytest.raises(SpeculatorsError, match="max_batch must be >= 1"):
        BatchRunner(engine, max_batch=0)
    assert engine.totals.target_calls == calls_before


def test_no_memory_for_another_slot_fails_that_request_only(tiny_llama, monkeypatch) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "none", max_len=128)
    want = engine.generate(PROMPTS[0], _params(2))

    def out_of_memory():
        raise MemoryError("no room for another KV cache")

    monkeypatch.setattr(engine, "new_slot", out_of_memory)
    runner = BatchRunner(engine, max_batch=2)
    first = runner.add(engine.encode(PROMPTS[0]), _params(2))  # takes the engine's own slot
    second = runner.add(engine.encode(PROMPTS[1]), _params(2))
    runner.run()
    assert first.output.token_ids == want.token_ids
    assert isinstance(second.error, MemoryError) and second.done and second.output is None
