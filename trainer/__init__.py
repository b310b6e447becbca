"""Tessera: the commands at this level, the machinery in folders named for their concern (docs/architecture.md)."""
from tessera import import_time

import_time.install()  # DeepSpeed imported without mlflow (1.5 s per process): tessera/import_time.py
