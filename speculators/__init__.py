"""speculators: train, evaluate, export and serve speculative-decoding drafters (see docs/architecture.md)."""

__version__ = "0.1.0"
