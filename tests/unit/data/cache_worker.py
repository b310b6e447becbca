"""A process that builds a tokenization-cache entry, for test_data's concurrency test.

Kept in its own light module (numpy and trainer.data.store only) so that each spawned process starts in a
fraction of a second instead of importing torch through the test module.
"""
from __future__ import annotations

import os
import time

import numpy as np

from trainer.data.store import build_or_load

VOCAB = 264
NUM_DOCS, DOC_LEN = 40, 25


def expected_tokens() -> list:
    return np.concatenate([np.arange(i, i + DOC_LEN) % 250 for i in range(NUM_DOCS)]).tolist()


def _produce():
    for i in range(NUM_DOCS):
        time.sleep(0.005)  # slow enough that the other processes arrive while the first one builds
        yield np.arange(i, i + DOC_LEN) % 250, None


def build_concurrently(cache_dir: str, barrier, results) -> None:
    """Wait for the other processes, build (or wait for and read) the same entry, report what was seen."""
    logs = []
    try:
        barrier.wait(timeout=60)
        store = build_or_load(cache_dir, {"test": "concurrent"}, "text", VOCAB, _produce, log=logs.append)
        results.put((os.getpid(), store.path, np.asarray(store.tokens).tolist(), logs))
    except BaseException as e:  # the test reports it instead of waiting for a result that never comes
        results.put((os.getpid(), None, None, [f"error: {type(e).__name__}: {e}"]))
        raise
