"""Bundled runtime (DESIGN §7): sampling operator, lossless tree verification and the generation engine.

Only light modules are imported here (torch only); `Engine` (which pulls in transformers-facing code) is
imported lazily on first access: `from speculators.serving import Engine, SamplingParams`.
"""

from __future__ import annotations

from typing import Any

from speculators.core.sampling import SamplingParams
from speculators.serving.verify import verify_tree

__all__ = ["Engine", "GenerateOutput", "SamplingParams", "verify_tree"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "GenerateOutput"):
        from speculators.serving import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'speculators.serving' has no attribute {name!r}")
