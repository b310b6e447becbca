"""The deterministic global sampler.

Global batch k is a pure function of (seed, number of sequences, global batch size, k): epoch e = k // B
uses a permutation seeded by (seed, e), and batch k takes its next `global_batch_size` entries (the tail of an
epoch that does not fill a batch is dropped). World size and micro-batch size only decide how a global batch
is sliced, so they never change what is trained on. The loader's position is just k, which a checkpoint
carries; resuming at another data-parallel degree continues the same sequence of global batches.
"""
from __future__ import annotations

from typing import List

import numpy as np

from tessera.errors import DataError


class GlobalBatchSampler:
    def __init__(self, num_sequences: int, global_batch_size: int, seed: int):
        if num_sequences < global_batch_size:
            raise DataError(f"the training split has {num_sequences} sequences, fewer than "
                            f"train.global_batch_size={global_batch_size}; add data, lower data.seq_len or "
                            f"lower train.global_batch_size")
        self.n, self.gbs, self.seed = num_sequences, global_batch_size, seed
        self.batches_per_epoch = num_sequences // global_batch_size
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._perm, self._epoch = rng.permutation(self.n), epoch
        return self._perm

    def epoch_of(self, k: int) -> int:
        return k // self.batches_per_epoch

    def global_batch(self, k: int) -> np.ndarray:
        epoch, j = divmod(k, self.batches_per_epoch)
        return self._permutation(epoch)[j * self.gbs:(j + 1) * self.gbs]

    def micro_batches(self, k: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> List[np.ndarray]:
        """This data-parallel rank's contiguous slice of global batch k, cut into micro-batches."""
        local = rank_slice(self.global_batch(k), dp_rank, dp_size)
        return [local[i:i + micro_batch_size] for i in range(0, len(local), micro_batch_size)]

    def state_dict(self, consumed_batches: int) -> dict:
        return {"consumed_batches": consumed_batches, "num_sequences": self.n, "global_batch_size": self.gbs,
                "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: batch k is a function of k (the run's step)."""

    def bind(self, stop, watchdog, log, run_dir: str, step: int) -> None:
        """Nothing of the run is needed (a followed source waits with the run's stop request: data/follow.py)."""


def rank_slice(items: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
    per = len(items) // dp_size
    return items[dp_rank * per:(dp_rank + 1) * per]
