"""Several requests behind the same step: one target forward per cycle for every running request.

`BatchRunner(engine, max_batch)` runs requests in lockstep. Each request is the engine's own coroutine
(`Engine.request`: prefill, drafting, verification, commits, EOS / stop handling and stats, exactly as when it runs
alone) in a `Slot` (KV cache) of its own. Each step, every running request verifies the rows of the previous forward,
commits, hands out its new tokens and drafts its next tree; then the runner stacks all the trees into ONE
`TargetRunner.forward_batch` (one pass over the weights for all of them; attention per request). New requests join
at the next step (their prefill runs as they join); finished or cancelled ones leave and free their slot.

Losslessness is per request and unchanged: a request's rows depend only on its own cache and tree, and it verifies
them with its own generator. The only coupling is rounding: a matrix product over more rows may round differently in
the last bit (as any change of batch size does), so a seeded sampled request repeats its tokens for the same batch
composition, and greedy outputs equal the target's greedy decoding up to exact ties. Adaptive depth keeps working
per request, but a shared forward's time says little about one tree, so batched cycles do not feed the cost model.

`BatchWorker` is a thread that owns a `BatchRunner` for the server: `submit` hands it a request and a callback that
receives each `StreamChunk`, then `None` when the request is over (or an exception when it failed).

Not here: chunked prefill (a joining request's prefill runs whole, delaying the others' next step once), batched
drafting (each request drafts alone), preemption, paged KV, priorities (first come, first served).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from speculators.core.errors import SpeculatorsError
from speculators.core.sampling import SamplingParams
from speculators.runtime.engine import Engine
from speculators.runtime.forward.target_runner import ForwardOutput
from speculators.runtime.requests import GenerateOutput, Slot, StreamChunk, VerifyForward

Emit = Callable[[StreamChunk | BaseException | None], None]


@dataclass
class Ticket:
    """One submitted request: its coroutine, its slot while running, and how it ended."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Emit | None = None
    text_deltas: bool = True
    output: GenerateOutput | None = None
    error: BaseException | None = None
    done: bool = False
    cancelled: bool = False
    slot: Slot | None = None
    tokens: int = 0  # generated so far
    coroutine: Generator[VerifyForward | StreamChunk, ForwardOutput | None, None] | None = None
    reply: ForwardOutput | None = field(default=None, repr=False)


class BatchRunner:
    """Runs submitted requests of one engine in lockstep, at most `max_batch` at a time (see the module docstring).
    Not thread-safe: one thread calls `add`, `cancel`, `step` (the server's `BatchWorker` is that thread)."""

    def __init__(self, engine: Engine, max_batch: int = 8) -> None:
        if max_batch < 1:
            raise SpeculatorsError(f"max_batch must be >= 1, got {max_batch}")
        engine.check_slots(int(max_batch))  # every slot the batch may fill, refused before the first is allocated
        self.engine, self.max_batch = engine, int(max_batch)
        self.waiting: deque[Ticket] = deque()
        self.running: list[Ticket] = []
        self._free_slots: list[Slot] = [engine.slot]
        self.steps = 0  # target forwards run
        self.batched_requests = 0  # requests over all of them (/ steps = mean batch size)
        self.largest_batch = 0  # the most requests that shared one forward
        self.cancelled = 0  # requests stopped because their client went away
        self.cancelled_tokens = 0  # tokens those requests had generated when they stopped

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, prompt_ids: list[int], params: SamplingParams, emit: Emit | None = None,
            text_deltas: bool = True) -> Ticket:
        """Queue a request; raises SpeculatorsError (one line) for one the engine cannot serve."""
        self.engine.check_request(prompt_ids, params)
        ticket = Ticket(list(prompt_ids), params, emit, text_deltas)
        self.waiting.append(ticket)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop a request (its client went away); it ends without an output at the next step."""
        ticket.cancelled = True

    def run(self) -> None:
        """Step until every request has ended."""
        while self.busy:
            self.step()

    def step(self) -> None:
        """One cycle of every running request: each verifies, commits and drafts, then one shared forward."""
        for ticket in [t for t in self.waiting if t.cancelled]:
            self.waiting.remove(ticket)
            self._end(ticket)
        while self.waiting and len(self.running) < self.max_batch:
            ticket = self.waiting.popleft()
            try:
                ticket.slot = self._free_slots.pop() if self._free_slots else self.engine.new_slot()
            except Exception as exc:  # noqa: BLE001 - e.g. no memory for another KV cache: this request fails
                ticket.error = exc
                self._end(ticket)
                continue
            ticket.coroutine = self.engine.request(ticket.prompt_ids, ticket.params, ticket.slot, ticket.text_deltas)
            self.running.append(ticket)
        calls: list[tuple[Ticket, VerifyForward]] = []
        for ticket in list(self.running):
            call = None if ticket.cancelled else self._advance(ticket)
            if call is None:
                self.running.remove(ticket)
                self._end(ticket)
            else:
                calls.append((ticket, call))
        if not calls:
            return
        for _, call in calls:
            call.shared = len(calls) > 1
        self.steps += 1
        self.batched_requests += len(calls)
        self.largest_batch = max(self.largest_batch, len(calls))
        try:
            capture = self.engine.captures and any(c.capture for _, c in calls)
            outputs = self.engine.runner.forward_batch([c.segment for _, c in calls], capture=capture)
        except Exception as exc:  # noqa: BLE001 - every request of this forward fails; the runner keeps serving
            for ticket, _ in calls:
                ticket.error = exc
                self.running.remove(ticket)
                self._end(ticket)
            return
        for (ticket, _), out in zip(calls, outputs, strict=True):
            ticket.reply = out

    def fail_all(self, error: BaseException) -> None:
        """End every running and waiting request with `error` (the runner itself stays usable)."""
        for ticket in [*self.running, *self.waiting]:
            ticket.error = error
            self._end(ticket)
        self.running.clear()
        self.waiting.clear()

    def _advance(self, ticket: Ticket) -> VerifyForward | None:
        """Run a request until it asks for its next forward (returned) or ends (None), handing out its chunks."""
        assert ticket.coroutine is not None
        while True:
            try:
                item = ticket.coroutine.send(ticket.reply)
            except StopIteration:
                return None
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                ticket.error = exc
                return None
            ticket.reply = None
            if isinstance(item, VerifyForward):
                return item
            ticket.tokens += len(item.token_ids)
            if ticket.emit is not None:
                ticket.emit(item)
            if item.output is not None:
                ticket.output = item.output
                return None

    def _end(self, ticket: Ticket) -> None:
        if ticket.cancelled and ticket.output is None and ticket.error is None:
            self.cancelled += 1
            self.cancelled_tokens += ticket.tokens
        if ticket.coroutine is not None:
            ticket.coroutine.close()
            ticket.coroutine = None
        if ticket.slot is not None:
            # a failed request may have stopped inside its prefill; a cancelled one stops between cycles, so its
            # prompt's cache is whole (a client that retries after a disconnect reuses it)
            if ticket.error is not None:
                ticket.slot.prefix_ids, ticket.slot.prefix_features = [], {}
            self._free_slots.append(ticket.slot)
            ticket.slot = None
        ticket.done = True
        if ticket.emit is not None:
            ticket.emit(ticket.error)  # None: ended normally (or cancelled)


def generate_batch(engine: Engine, prompts: list[Any], params: SamplingParams | list[SamplingParams],
                   max_batch: int = 8) -> list[GenerateOutput]:
    """Generate for every prompt, up to `max_batch` requests sharing each target forward; outputs in prompt order.
    Every prompt is checked before any runs (one bad prompt: SpeculatorsError, nothing generated)."""
    per_request = params if isinstance(params, list) else [params] * len(prompts)
    if len(per_request) != len(prompts):
        raise SpeculatorsError(f"got {len(prompts)} prompts but {len(per_request)} SamplingParams")
    runner = BatchRunner(engine, max_batch)
    # nothing runs before `run`: a bad prompt raises here, before any generation
    tickets = [runner.add(engine.encode(prompt), p, text_deltas=False)
               for prompt, p in zip(prompts, per_request, strict=True)]
    runner.run()
    outputs = []
    for ticket in tickets:
        if ticket.error is not None:
            raise ticket.error
        if ticket.output is None:
            raise SpeculatorsError("a batched request ended without an output")
        outputs.append(ticket.output)
    return outputs


class BatchWorker:
    """A daemon thread owning one `BatchRunner`: the server submits requests from its event loop, the thread
    steps them together. The engine must not be used by anyone else meanwhile."""

    def __init__(self, engine: Engine, max_batch: int = 8) -> None:
        self.runner = BatchRunner(engine, max_batch)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tickets: list[tuple[Ticket, threading.Event]] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="speculators-batch", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, emit: Emit, cancel: threading.Event,
               text_deltas: bool = True) -> None:
        """Queue a checked request; `emit` is called from the worker thread; setting `cancel` stops it."""
        self._inbox.put((prompt_ids, params, emit, cancel, text_deltas))

    def close(self, timeout: float = 10.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stopped:
            self._take(block=not self.runner.busy)
            for ticket, cancel in self._tickets:
                if cancel.is_set() and not ticket.done:
                    self.runner.cancel(ticket)
            try:
                self.runner.step()
            except Exception as exc:  # noqa: BLE001 - e.g. no memory for a new slot: fail what is queued, go on
                self.runner.fail_all(exc)
            self._tickets = [(t, c) for t, c in self._tickets if not t.done]

    def _take(self, block: bool) -> None:
        """Move submitted requests into the runner (waiting for one when idle)."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is None:
                self._stopped = True
                return
            prompt_ids, params, emit, cancel, text_deltas = item
            try:
                ticket = self.runner.add(prompt_ids, params, emit, text_deltas)
            except Exception as exc:  # noqa: BLE001 - reported to that request only
                emit(exc)
                continue
            self._tickets.append((ticket, cancel))
