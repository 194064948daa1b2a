"""EAGLE-3: its config (eagle3_config.py), the model (eagle3_model.py) and vLLM's speculators format (eagle3_format.py).

Light on purpose: the registry (models/__init__.py) imports the config module through this package."""
