"""The runtime library every stage and app builds on: the generation engine (prefill, draft -> verify -> commit
cycles), continuous batching and request handling, adaptive depth control and its calibration, the target forward
(`forward/`: runners, the target's KV cache, memory sizing), lossless tree verification (`verify/`) and the drafters
(`drafters/`: trained speculators loaded from a directory, n-gram and model-free drafters, grafting).

    from speculators.runtime import Engine, SamplingParams, verify_tree

Not here: HTTP serving, benchmarks (serving/), the cost oracle and `speculators profile` (oracle/), training.
"""

from __future__ import annotations

from speculators.core.sampling import SamplingParams
from speculators.runtime.engine import Engine
from speculators.runtime.requests import GenerateOutput
from speculators.runtime.verify.lossless import verify_tree

__all__ = ["Engine", "GenerateOutput", "SamplingParams", "verify_tree"]
