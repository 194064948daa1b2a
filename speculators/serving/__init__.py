"""Bundled runtime (DESIGN §7): sampling operator, lossless tree verification and the generation engine.

    from speculators.serving import Engine, SamplingParams, verify_tree
"""

from __future__ import annotations

from speculators.core.sampling import SamplingParams
from speculators.serving.engine import Engine
from speculators.serving.requests import GenerateOutput
from speculators.serving.verify import verify_tree

__all__ = ["Engine", "GenerateOutput", "SamplingParams", "verify_tree"]
