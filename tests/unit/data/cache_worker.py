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


PARTS, DOCS_PER_PART = 6, 8


def _part(i: int, marks: str):
    def produce():
        open(os.path.join(marks, f"part{i}-pid{os.getpid()}"), "w").close()
        for j in range(i * DOCS_PER_PART, (i + 1) * DOCS_PER_PART):
            time.sleep(0.01)  # slow enough that every process takes a share
            yield np.arange(j, j + DOC_LEN) % 250, None
    return produce


def expected_part_tokens() -> list:
    return np.concatenate([np.arange(j, j + DOC_LEN) % 250 for j in range(PARTS * DOCS_PER_PART)]).tolist()


def build_in_parts_concurrently(cache_dir: str, marks: str, barrier, results) -> None:
    """As build_concurrently, with the entry cut into PARTS parts that the processes share."""
    logs = []
    try:
        os.environ["LOCAL_RANK"] = str(barrier.wait(timeout=60))
        store = build_or_load(cache_dir, {"test": "parts"}, "text", VOCAB, lambda: iter(()), log=logs.append,
                              parts=lambda: [_part(i, marks) for i in range(PARTS)])
        results.put((os.getpid(), store.path, np.asarray(store.tokens).tolist(), logs))
    except BaseException as e:  # noqa: BLE001
        results.put((os.getpid(), None, None, [f"error: {type(e).__name__}: {e}"]))
        raise
