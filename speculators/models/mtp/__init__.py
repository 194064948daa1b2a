"""MTP: its config (mtp_config.py), the model (mtp_model.py) and the target MTP slot vLLM serves it from
(mtp_format.py; export/mtp_stitch.py writes it).

Light on purpose: the registry (models/__init__.py) imports the config module through this package."""
