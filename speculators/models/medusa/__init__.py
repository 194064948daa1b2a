"""Medusa: its config (medusa_config.py), the model (medusa_model.py) and vLLM's Medusa format (medusa_format.py).

Light on purpose: the registry (models/__init__.py) imports the config module through this package."""
