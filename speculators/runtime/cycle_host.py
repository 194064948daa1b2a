"""`CycleHost`: what the steps around a cycle (cycle_steps.py) and the cost calibration (calibration.py) read from
the engine that runs them, as a typed protocol. `runtime.engine.Engine` satisfies it; the steps import this protocol
instead of the engine, which imports them.

Not here: the engine itself (engine.py), the steps (cycle_steps.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from speculators.core.config import TreeConfig
    from speculators.core.sampling import SamplingParams
    from speculators.core.trees import DraftTree
    from speculators.runtime.acceptance_memory import AcceptanceMemory
    from speculators.runtime.cycle_costs import CostModel
    from speculators.runtime.drafters.load import DrafterInfo
    from speculators.runtime.drafters.model_free import Drafter, NgramDrafter
    from speculators.runtime.forward.target_rows import TargetRows
    from speculators.runtime.forward.target_runner import ForwardOutput, RunnerBase
    from speculators.runtime.recording import TrafficRecorder


class CycleHost(Protocol):
    """The engine as its cycle steps see it: the drafters, the drafting settings, the costs and memory it keeps,
    the target runner, and verification."""

    drafter: Drafter  # the model drafter (or prompt lookup, or none)
    info: DrafterInfo  # which drafter (and draft revision) that is
    lookup: NgramDrafter | None  # prompt lookup besides the model drafter (grafted on, or drafted alone)
    lookup_depth: int  # the lookup's chain drafted alone
    graft_nodes: int  # the most lookup nodes grafted onto a model tree
    tree: TreeConfig
    cost: CostModel
    acceptance_memory: AcceptanceMemory
    runner: RunnerBase
    speculative: bool
    adaptive: bool
    prefix_caching: bool
    cost_cache: bool  # costs from / kept in the cache root (cost_cache.py)
    adaptive_requests: int  # requests served under the adaptive controller
    max_len: int
    eos_ids: set[int]
    recorder: TrafficRecorder | None  # served requests written as training rows

    @property
    def captures(self) -> bool: ...

    @property
    def device(self) -> torch.device: ...

    def kinds_for(self, params: SamplingParams, adaptive: bool) -> tuple[str, ...]: ...

    def tree_for(self, depth: int, kind: str | None = None) -> TreeConfig: ...

    def accept(self, tree: DraftTree, fwd: ForwardOutput, params: SamplingParams, generator: torch.Generator | None,
               premade: list[int] | None = None) -> tuple[list[int], int, TargetRows]: ...
