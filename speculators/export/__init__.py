"""Export: vLLM-loadable checkpoints (speculators format, Medusa format), MTP, and pairing records."""
