"""Start-up time that third-party packages cost without a use.

The cyclic garbage collector: importing torch, transformers and DeepSpeed creates about half a million objects,
and each collection of the oldest generation walks all of them again: during the imports, every few steps of
training, at the end of the run and at interpreter exit (measured on a tiny run: 5.1-5.6 s of user CPU, 3.3-3.7 s
with the collector paused during the imports and the imported objects frozen). `pause_collector()` first thing in
a process Tessera starts and `freeze_imported()` once its imports are done (or `with imports_frozen():` around
imports made in a function) move those objects out of the collector's sight (`gc.freeze`, as CPython's
documentation suggests for a process's start-up); what the run creates later is collected as usual.

DeepSpeed's autotuner (run only by
`deepspeed --autotuning`) imports mlflow at every `import deepspeed` when mlflow is installed, 1.5 s of CPU in
each DeepSpeed rank, DeepSpeed runner and every HF export (transformers' save_pretrained imports deepspeed through
accelerate). `install()` (run by `import trainer` and `import models`) makes that one import fail as if mlflow
were absent, which the autotuner already handles; everyone else, experiment trackers included, imports mlflow as
usual."""
from __future__ import annotations

import gc
import importlib.abc
import sys
from contextlib import contextmanager

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


def pause_collector() -> None:
    """Stop the cyclic collector for the imports of a process's start-up (see the module's docstring)."""
    gc.disable()


def freeze_imported() -> None:
    """Everything allocated so far (the imported modules) leaves the collector's generations; collection resumes."""
    gc.freeze()
    gc.enable()


@contextmanager
def imports_frozen():
    """The imports inside the block made with the collector paused, then frozen (also when one fails)."""
    pause_collector()
    try:
        yield
    finally:
        freeze_imported()
