"""GlobalBatchSampler: what is trained on depends only on (seed, data size, global batch size, step)."""
from __future__ import annotations

import numpy as np
import pytest

from trainer.data.sampler import GlobalBatchSampler, rank_slice
from tessera.errors import DataError

N, GBS, SEED = 203, 16, 1234  # 203 // 16 = 12 batches per epoch, 11 sequences dropped each epoch


def _reassemble(sampler, k, dp_size, mbs):
    """Every rank's micro-batches of step k, concatenated in rank order."""
    parts = []
    for rank in range(dp_size):
        micro = sampler.micro_batches(k, rank, dp_size, mbs)
        assert len(micro) == GBS // (dp_size * mbs)
        assert all(len(m) == mbs for m in micro)
        parts += micro
    return np.concatenate(parts)


@pytest.mark.parametrize("dp_size,mbs", [(1, 16), (1, 4), (1, 1), (2, 8), (2, 2), (4, 4), (4, 1)])
def test_global_batches_independent_of_dp_and_micro_batch(dp_size, mbs):
    reference = GlobalBatchSampler(N, GBS, SEED)
    sampler = GlobalBatchSampler(N, GBS, SEED)
    for k in list(range(30)) + [100, 57]:  # crosses epoch boundaries (12 batches per epoch) and goes back
        expected = reference.global_batch(k)
        assert len(expected) == GBS
        np.testing.assert_array_equal(_reassemble(sampler, k, dp_size, mbs), expected)


def test_ranks_get_disjoint_contiguous_slices():
    s = GlobalBatchSampler(N, GBS, SEED)
    batch = s.global_batch(3)
    slices = [np.concatenate(s.micro_batches(3, r, 4, 2)) for r in range(4)]
    for r, sl in enumerate(slices):
        np.testing.assert_array_equal(sl, batch[r * 4:(r + 1) * 4])
    assert len(set(np.concatenate(slices).tolist())) == GBS
    np.testing.assert_array_equal(rank_slice(np.arange(8), 1, 2), [4, 5, 6, 7])


def test_each_epoch_is_a_permutation():
    s = GlobalBatchSampler(N, GBS, SEED)
    assert s.batches_per_epoch == 12
    epochs = []
    for e in range(3):
        items = np.concatenate([s.global_batch(e * 12 + j) for j in range(12)])
        assert len(items) == 12 * GBS
        assert len(np.unique(items)) == 12 * GBS  # no repeats inside an epoch
        assert items.min() >= 0 and items.max() < N
        assert all(s.epoch_of(e * 12 + j) == e for j in range(12))
        epochs.append(items)
    # epochs are shuffled differently (and drop different tails)
    assert not np.array_equal(epochs[0], epochs[1])
    assert set(range(N)) - set(epochs[0].tolist()) != set(range(N)) - set(epochs[1].tolist())


def test_exact_fit_covers_everything():
    s = GlobalBatchSampler(64, 16, 7)
    items = np.concatenate([s.global_batch(k) for k in range(4)])
    np.testing.assert_array_equal(np.sort(items), np.arange(64))
    assert s.epoch_of(4) == 1


def test_same_seed_same_batches_and_different_seed_differs():
    a, b, c = GlobalBatchSampler(N, GBS, 1), GlobalBatchSampler(N, GBS, 1), GlobalBatchSampler(N, GBS, 2)
    for k in range(25):
        np.testing.assert_array_equal(a.global_batch(k), b.global_batch(k))
    differing = sum(not np.array_equal(a.global_batch(k), c.global_batch(k)) for k in range(25))
    assert differing == 25


def test_batches_are_random_access():
    """Resuming at step k (a fresh sampler) gives what an uninterrupted run sees at step k."""
    running = GlobalBatchSampler(N, GBS, SEED)
    seen = [running.global_batch(k).copy() for k in range(40)]
    for k in (39, 0, 13, 12, 24):
        np.testing.assert_array_equal(GlobalBatchSampler(N, GBS, SEED).global_batch(k), seen[k])


def test_state_dict():
    s = GlobalBatchSampler(N, GBS, SEED)
    assert s.state_dict(5) == {"consumed_batches": 5, "num_sequences": N, "global_batch_size": GBS, "seed": SEED}


def test_too_small_data_raises():
    with pytest.raises(DataError, match="train.global_batch_size=16"):
        GlobalBatchSampler(15, 16, 0)
    GlobalBatchSampler(16, 16, 0)  # exactly one batch is enough
