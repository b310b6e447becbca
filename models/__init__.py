"""Hugging Face models: presets, loading, tensor-parallel plans, pipeline splits, LoRA."""
from tessera import import_time

import_time.install()  # DeepSpeed imported without mlflow (1.5 s per process): tessera/import_time.py
