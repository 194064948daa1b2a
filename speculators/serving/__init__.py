"""The serving apps on top of the runtime: the OpenAI-compatible HTTP server (`server`, `openai_api`, `http_guard`,
`server_metrics`), the `generate` / `serve` commands (`commands`) and `speculators bench` (`bench`).

The runtime itself moved to `speculators.runtime`; these names stay importable from here:

    from speculators.serving import Engine, SamplingParams, verify_tree
"""

from __future__ import annotations

from speculators.core.sampling import SamplingParams
from speculators.runtime import Engine, GenerateOutput, verify_tree

__all__ = ["Engine", "GenerateOutput", "SamplingParams", "verify_tree"]
