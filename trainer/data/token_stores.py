"""`data=tokens data.path=<store folder, glob or comma list>`: training sequences over the sharded token stores that
`python -m trainer.tokenize` writes, in O(1) memory per sequence whatever the corpus size.

- Each shard is cut into sequences like a cache entry (packing=eos: windows of seq_len + 1 tokens; SFT: one
  example per sequence; packing=documents: whole documents per row); sequences never cross shards. Shards are
  opened (memory-mapped) when read, at most MAX_OPEN_SHARDS at a time.
- The validation split and the order of the global batches are seeded bijections of the sequence numbers
  (IndexPermutation: a Feistel network), evaluated one index at a time: no array of all sequence numbers is ever
  held, and global batch k stays a pure function of (seed, store, global batch size, sequence length, k), so
  world-size independence and exact resume hold as for every other source.
"""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Callable, List

import numpy as np
import torch

from tessera.errors import DataError
from trainer.data import shards as S
from trainer.data.sampler import GlobalBatchSampler
from trainer.data.store import TokenStore, tokenizer_fingerprint

MAX_OPEN_SHARDS = 64
_MASK64 = (1 << 64) - 1


def _mix(values: np.ndarray, key: int) -> np.ndarray:
    """splitmix64 of (values ^ key), elementwise on uint64."""
    with np.errstate(over="ignore"):
        z = (values ^ np.uint64(key)) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class IndexPermutation:
    """A seeded bijection of [0, n): a 4-round Feistel network on the smallest even-bit domain >= n, walked
    again while a value falls outside [0, n) (cycle walking: fewer than 4 rounds on average)."""

    def __init__(self, n: int, seed):
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.low = np.uint64((1 << self.half) - 1)
        digest = hashlib.sha256(repr(("tessera-permutation", seed)).encode()).digest()
        self.keys = [int.from_bytes(digest[8 * r:8 * r + 8], "little") for r in range(4)]

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self.half), x & self.low
        for key in self.keys:
            left, right = right, left ^ (_mix(right, key) & self.low)
        return (left << np.uint64(self.half)) | right

    def __call__(self, positions) -> np.ndarray:
        x = np.asarray(positions, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"position {int(x.max())} outside [0, {self.n})")
        out = self._rounds(x)
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._rounds(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)

    def __getitem__(self, key: slice) -> np.ndarray:
        return self(np.arange(*key.indices(self.n), dtype=np.int64))

    def __len__(self):
        return self.n


class PermutedSubset:
    """Positions [offset, offset + length) of a permutation of the sequences: the train or the validation part."""

    def __init__(self, base, perm: IndexPermutation, offset: int, length: int):
        self.base, self.perm, self.offset, self.length = base, perm, offset, length

    def __len__(self):
        return self.length

    def _sequences(self, positions) -> np.ndarray:
        return self.perm(np.asarray(positions, dtype=np.int64) + self.offset)

    def get(self, positions) -> dict:
        return self.base.get(self._sequences(positions))

    def count_targets(self, positions) -> int:
        return self.base.count_targets(self._sequences(positions))


class LazyOrderSampler(GlobalBatchSampler):
    """The global-batch sampler over a PermutedSubset: each epoch's order a seeded IndexPermutation, not an array."""

    def _permutation(self, epoch: int):
        if epoch != self._epoch:
            self._perm, self._epoch = IndexPermutation(self.n, ("order", self.seed, epoch)), epoch
        return self._perm


class ShardedSequences:
    """The sequences of every shard of the stores, numbered shard after shard. `make(store)` cuts one shard (a
    TokenStore) into sequences; `counts` are the shards' sequence counts, known without opening them."""

    def __init__(self, folders: List[str], metas: List[dict], counts: List[int], make: Callable):
        self.folders, self.metas, self.make = folders, metas, make
        self.starts = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])
        self._open: OrderedDict = OrderedDict()

    def __len__(self):
        return int(self.starts[-1])

    def shard(self, i: int):
        """Shard i's sequences, memory-mapped on first use; the least recently used shard is closed beyond
        MAX_OPEN_SHARDS."""
        if i in self._open:
            self._open.move_to_end(i)
        else:
            self._open[i] = self.make(TokenStore(self.folders[i], self.metas[i]))
            if len(self._open) > MAX_OPEN_SHARDS:
                self._open.popitem(last=False)
        return self._open[i]

    def _by_shard(self, indices):
        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self.starts, indices, side="right") - 1
        for i in np.unique(which):
            rows = np.nonzero(which == i)[0]
            yield int(i), rows, indices[rows] - self.starts[i]

    def get(self, indices) -> dict:
        parts, order = [], []
        for i, rows, local in self._by_shard(indices):
            parts.append(self.shard(i).get(local))
            order.append(rows)
        back = np.argsort(np.concatenate(order), kind="stable")
        return {k: torch.cat([p[k] for p in parts])[torch.from_numpy(back)] for k in parts[0]}

    def count_targets(self, indices) -> int:
        return sum(self.shard(i).count_targets(local) for i, _, local in self._by_shard(indices))


def open_stores(path_spec: str, tokenizer, vocab_size: int):
    """(folders, shard metas, kind, identity) of every shard of the stores data.path names, checked against this
    run's tokenizer and vocabulary."""
    folders, metas, kinds, digests = [], [], set(), hashlib.sha256()
    fingerprint = tokenizer_fingerprint(tokenizer)
    for folder, manifest in S.iter_manifests(path_spec):
        if manifest.get("format") != S.STORE_FORMAT or manifest.get("version") != S.STORE_VERSION:
            raise DataError(f"data.path: {folder!r} is not a token store of this version ({S.MANIFEST} says "
                            f"{manifest.get('format')!r} {manifest.get('version')!r})")
        if manifest["tokenizer"] != fingerprint:
            raise DataError(f"data.path: {folder!r} was tokenized with another tokenizer than this run's model.*; "
                            f"tokenize it again with the same model= overrides (python -m trainer.tokenize)")
        if manifest["vocab_size"] > vocab_size:
            raise DataError(f"data.path: {folder!r} holds token ids up to {manifest['vocab_size'] - 1}, beyond the "
                            f"model's vocabulary ({vocab_size})")
        kinds.add(manifest["kind"])
        for shard in manifest["shards"]:
            path = os.path.join(folder, S.SHARDS, S.shard_name(shard["index"]))
            damage = S.shard_damage(path)  # by size: a shard removed or cut short since the manifest was written
            if damage is not None:
                raise DataError(f"data.path: shard {shard['index']} of {folder!r} is damaged ({damage}); run the "
                                f"same python -m trainer.tokenize command again (it rewrites damaged shards)")
            folders.append(path)
            metas.append(shard)
            digests.update(shard["files"]["tokens.bin"]["sha256"].encode())
    if len(kinds) > 1:
        raise DataError(f"data.path names token stores of text and of SFT records ({path_spec}); train on one kind, "
                        f"or make them sources of a mixture")
    return folders, metas, kinds.pop(), digests.hexdigest()[:16]
