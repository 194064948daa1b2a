"""DFlash: its config (dflash_config.py), the model (dflash_model.py) and vLLM's speculators format (dflash_format.py).

Light on purpose: the registry (models/__init__.py) imports the config module through this package."""
