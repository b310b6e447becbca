"""Start-up time that third-party packages cost without a use: DeepSpeed's autotuner (run only by
`deepspeed --autotuning`) imports mlflow at every `import deepspeed` when mlflow is installed, 1.5 s of CPU in
each DeepSpeed rank, DeepSpeed runner and every HF export (transformers' save_pretrained imports deepspeed through
accelerate). `install()` (run by `import trainer` and `import models`) makes that one import fail as if mlflow
were absent, which the autotuner already handles; everyone else, experiment trackers included, imports mlflow as
usual."""
from __future__ import annotations

import importlib.abc
import sys

AUTOTUNER = "deepspeed.autotuning.autotuner"


def _initializing(name: str) -> bool:
    """Module `name` is being executed right now (its import has begun and not finished)."""
    module = sys.modules.get(name)
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class SkipMlflowForDeepSpeedAutotuner(importlib.abc.MetaPathFinder):
    """Refuses `import mlflow` while DeepSpeed's autotuner module is being imported, and only then."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "mlflow" and _initializing(AUTOTUNER):
            raise ModuleNotFoundError("mlflow is not imported for DeepSpeed's autotuner (tessera/import_time.py)",
                                      name="mlflow")
        return None


def install() -> None:
    """Put the finder first on sys.meta_path, once per process."""
    if not any(isinstance(f, SkipMlflowForDeepSpeedAutotuner) for f in sys.meta_path):
        sys.meta_path.insert(0, SkipMlflowForDeepSpeedAutotuner())
