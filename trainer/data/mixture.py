"""Multi-task mixtures (data.kind=mixture): named sources, each with its own format, data, split and loss.

Every source is tokenized, packed and split as a single source would be. Global batches mix them by weight
(data.sources[i].weight, or each source's training sequences^(1/data.temperature)) through one deterministic
order of all sources' sequences, the Sainte-Laguë (Webster) divisor sequence: the j-th sequence of source i
comes at time (j + 1/2) / w_i, and the sequences are trained in the order of their times (ties: the earlier
source). Global batch k is the (kB)-th to ((k+1)B)-th of them, a pure function of k, the weights and the
seed: every batch follows the weights as closely as whole sequences allow, the same at any world size or
micro-batch size, and a resumed run continues the same sequence. Each source goes through its training
sequences in epochs of its own, each in a permutation seeded by (train.seed, source, epoch).

Each batch item carries its task index ("task"), so the strategies add every row's loss to its task's sum:
metrics.jsonl gets per-task loss and target tokens, eval.jsonl a validation loss per task. A mixture of preference
sources (objective=dpo, ...) gives per-task pair losses, pairs and the objective's rewards and accuracy.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
import torch

from trainer.data.sampler import rank_slice
from tessera.errors import DataError


class MixtureSequences:
    """The sources' sequences one after another: index g < len(parts[0]) is source 0's, and so on."""

    def __init__(self, parts: Sequence):
        self.parts = list(parts)
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self):
        return int(self.offsets[-1])

    def _split(self, indices):
        indices = np.asarray(indices, dtype=np.int64)
        task = np.searchsorted(self.offsets, indices, side="right") - 1
        return indices, task

    def get(self, indices) -> dict:
        """The items' batch with each item's task ("task": one per item; a preference pair's two rows share it)."""
        indices, task = self._split(indices)
        order = np.argsort(task, kind="stable")  # the items grouped by source: one read from each
        parts = [self.parts[t].get(indices[task == t] - self.offsets[t]) for t in np.unique(task)]
        back = np.argsort(order)  # and back into the batch's order
        batch = {key: _reordered(torch.cat([p[key] for p in parts]), back) for key in parts[0]}
        batch["task"] = torch.from_numpy(task)
        return batch

    def count_targets(self, indices) -> int:
        indices, task = self._split(indices)
        return sum(self.parts[t].count_targets(indices[task == t] - self.offsets[t]) for t in np.unique(task))


def _reordered(rows: torch.Tensor, back: np.ndarray) -> torch.Tensor:
    """`rows` (k rows per item, the items in source order) in the batch's item order `back`."""
    per_item = rows.shape[0] // len(back)
    index = (back[:, None] * per_item + np.arange(per_item)).reshape(-1)
    return rows[torch.from_numpy(index)]


class MixtureSampler:
    """Global batches over MixtureSequences in the weighted order described in the module docstring."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch_size: int, seed: int):
        self.sizes = np.asarray(sizes, dtype=np.int64)
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self.active = np.nonzero(self.weights > 0)[0]
        self.offsets = np.cumsum([0] + list(self.sizes))
        self.gbs, self.seed = global_batch_size, seed
        self.n = int(self.sizes[self.active].sum())
        if self.n < global_batch_size:
            raise DataError(f"the mixture's training splits have {self.n} sequences, fewer than "
                            f"train.global_batch_size={global_batch_size}; add data, lower data.seq_len or "
                            f"lower train.global_batch_size")
        self.batches_per_epoch = max(1, self.n // global_batch_size)
        self._perms = {}
        self._last = (None, None)  # (k, global batch k): the loop asks for a batch, then for its micro-batches

    # ---- the order: the first J sequences of the weighted sequence, per source ---------------------------------
    def _time(self, i: int, j: int) -> float:
        return (j + 0.5) / self.weights[i]

    def counts(self, total: int) -> np.ndarray:
        """How many of each source's sequences the first `total` of the order hold."""
        c = np.zeros(len(self.weights), dtype=np.int64)
        c[self.active] = np.floor(total * self.weights[self.active]).astype(np.int64)  # within 1 of the answer
        while c.sum() > total:  # drop the latest
            i = max(self.active[c[self.active] > 0], key=lambda s: (self._time(s, c[s] - 1), s))
            c[i] -= 1
        while c.sum() < total:  # add the earliest
            i = min(self.active, key=lambda s: (self._time(s, c[s]), s))
            c[i] += 1
        while True:  # swap while the latest taken comes after the earliest not taken
            taken = [s for s in self.active if c[s] > 0]
            if not taken:
                return c
            late = max(taken, key=lambda s: (self._time(s, c[s] - 1), s))
            early = min(self.active, key=lambda s: (self._time(s, c[s]), s))
            if (self._time(early, c[early]), early) >= (self._time(late, c[late] - 1), late):
                return c
            c[late] -= 1
            c[early] += 1

    def _local(self, i: int, j: int) -> int:
        """Source i's j-th sequence in the order: its epochs, each a seeded permutation of its training split."""
        epoch, at = divmod(j, int(self.sizes[i]))
        if (i, epoch) not in self._perms:
            if len(self._perms) > 4 * len(self.sizes):
                self._perms.clear()
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, i, epoch])))
            self._perms[i, epoch] = rng.permutation(int(self.sizes[i]))
        return int(self._perms[i, epoch][at])

    def global_batch(self, k: int) -> np.ndarray:
        if self._last[0] != k:
            lo, hi = self.counts(k * self.gbs), self.counts((k + 1) * self.gbs)
            items = sorted((self._time(i, j), i, j) for i in self.active for j in range(lo[i], hi[i]))
            self._last = (k, np.asarray([self.offsets[i] + self._local(i, j) for _, i, j in items], dtype=np.int64))
        return self._last[1]

    def epoch_of(self, k: int) -> int:
        return k // self.batches_per_epoch

    def micro_batches(self, k: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> List[np.ndarray]:
        local = rank_slice(self.global_batch(k), dp_rank, dp_size)
        return [local[i:i + micro_batch_size] for i in range(0, len(local), micro_batch_size)]

    def state_dict(self, consumed_batches: int) -> dict:
        return {"consumed_batches": consumed_batches, "num_sequences": self.n, "global_batch_size": self.gbs,
                "seed": self.seed, "weights": [float(w) for w in self.weights]}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: batch k is a function of k."""

    def bind(self, stop, watchdog, log, run_dir: str, step: int) -> None:
        """Nothing of the run is needed."""


@dataclass
class MixtureSplits:
    """DataSplits of a mixture: the sources' splits side by side, the weighted sampler, per-task validation."""
    train: MixtureSequences
    val: MixtureSequences
    fingerprint: str
    num_tokens: int
    description: str
    tasks: tuple
    weights: tuple
    sources: tuple = ()  # the sources' own DataSplits (a preference source's reference scores are its own)
    reference_key: str = ""  # objective=dpo|ipo: the sources' reference keys together

    def sampler(self, global_batch_size: int, seed: int) -> MixtureSampler:
        return MixtureSampler([len(p) for p in self.train.parts], self.weights, global_batch_size, seed)

    def val_of_task(self, task: int):
        return _TaskView(self.val, task)


class _TaskView:
    """One task's validation sequences, indexed from 0, as MixtureSequences rows (with their task index)."""

    def __init__(self, mixture: MixtureSequences, task: int):
        self.mixture, self.offset, self.n = mixture, int(mixture.offsets[task]), len(mixture.parts[task])

    def __len__(self):
        return self.n

    def get(self, positions) -> dict:
        return self.mixture.get(np.asarray(positions, dtype=np.int64) + self.offset)

    def count_targets(self, positions) -> int:
        return self.mixture.count_targets(np.asarray(positions, dtype=np.int64) + self.offset)


def build_mixture(d, splits) -> MixtureSplits:
    """The mixture of the sources' DataSplits (in data.sources order) with their weights."""
    names = tuple(s.name for s in d.sources)
    sizes = [len(s.train) for s in splits]
    if all(s.weight is not None for s in d.sources):
        weights = tuple(float(s.weight) for s in d.sources)
        how = "weights"
    else:
        weights = tuple(float(n) ** (1.0 / d.temperature) for n in sizes)
        how = f"sizes^(1/{d.temperature:g})"
    total = sum(weights)
    parts = ", ".join(f"{n} {w / total:.1%}" for n, w in zip(names, weights))
    identity = "|".join(f"{n}={s.fingerprint}@{w!r}" for n, s, w in zip(names, splits, weights))
    fingerprint = "mix:" + hashlib.sha256(identity.encode()).hexdigest()[:16]
    desc = f"mixture of {len(names)} sources by {how} ({parts}); " + "; ".join(
        f"{n}: {s.description}" for n, s in zip(names, splits))
    return MixtureSplits(MixtureSequences([s.train for s in splits]), MixtureSequences([s.val for s in splits]),
                         fingerprint, sum(s.num_tokens for s in splits), desc, names, weights, tuple(splits))
