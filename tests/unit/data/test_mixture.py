"""data.kind=mixture: the weighted order of the sources' sequences (a pure function of the batch index that follows
the weights within one sequence at every prefix), each source's epochs, the rows' task column, and the config
checks of the sources."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import compose_config
from trainer.config import schema as C
from trainer.data.mixture import MixtureSampler, MixtureSequences


def test_every_prefix_of_the_order_follows_the_weights_within_one_sequence():
    sampler = MixtureSampler([50, 30, 7], [0.5, 0.3, 0.2], global_batch_size=4, seed=0)
    previous = np.zeros(3, dtype=np.int64)
    for total in range(0, 400):
        counts = sampler.counts(total)
        assert counts.sum() == total
        assert np.all(np.abs(counts - total * sampler.weights) < 1.0), (total, counts)
        assert np.all(counts >= previous) and (counts - previous).sum() == (1 if total else 0)  # one at a time
        previous = counts


def test_a_batch_is_a_pure_function_of_its_index():
    sizes, weights = [50, 30, 7], [2.0, 1.0, 1.0]
    a = MixtureSampler(sizes, weights, 8, seed=3)
    forward = [a.global_batch(k).tolist() for k in range(40)]
    b = MixtureSampler(sizes, weights, 8, seed=3)
    assert [b.global_batch(k).tolist() for k in reversed(range(40))] == forward[::-1]  # any order, fresh sampler
    assert MixtureSampler(sizes, weights, 8, seed=4).global_batch(0).tolist() != forward[0]  # the seed matters
    # each source goes through its training split in epochs: every sequence once per epoch
    offsets = np.cumsum([0] + sizes)
    flat = np.concatenate(forward)
    small = flat[(flat >= offsets[2]) & (flat < offsets[3])] - offsets[2]
    for epoch in range(len(small) // 7):
        assert sorted(small[7 * epoch:7 * epoch + 7].tolist()) == list(range(7))


def test_data_parallel_ranks_split_each_batch_whatever_the_world_size():
    sampler = MixtureSampler([20, 20], [1.0, 3.0], 8, seed=0)
    for k in range(5):
        whole = sampler.global_batch(k).tolist()
        for world in (1, 2, 4):
            parts = [np.concatenate(sampler.micro_batches(k, r, world, 1)).tolist() for r in range(world)]
            assert sum(parts, []) == whole


def test_a_source_with_weight_zero_is_never_sampled():
    sampler = MixtureSampler([10, 10], [1.0, 0.0], 4, seed=0)
    assert all((sampler.global_batch(k) < 10).all() for k in range(10))


class _Part:
    """A source's split: `n` rows whose tokens are (source id, row)."""

    def __init__(self, source: int, n: int):
        self.source, self.n = source, n

    def __len__(self):
        return self.n

    def get(self, indices):
        import torch

        rows = torch.tensor([[self.source, i] for i in indices])
        return {"input_ids": rows, "labels": rows}

    def count_targets(self, indices):
        return 10 * (self.source + 1) * len(indices)


def test_rows_carry_their_task_and_are_counted_by_their_source():
    mix = MixtureSequences([_Part(0, 3), _Part(1, 5)])
    batch = mix.get([4, 0, 7])
    assert batch["input_ids"].tolist() == [[1, 1], [0, 0], [1, 4]]
    assert batch["task"].tolist() == [1, 0, 1]
    assert mix.count_targets([4, 0, 7]) == 20 + 10 + 20 and len(mix) == 8


class _Pairs(_Part):
    """A preference source: each item two rows (chosen, rejected) and one pair id."""

    def get(self, indices):
        import torch

        rows = torch.tensor([[self.source, i, side] for i in indices for side in (0, 1)])
        return {"input_ids": rows, "labels": rows, "pair_ids": torch.tensor(list(indices)),
                "reference_logps": rows[:, 1] * 10.0 + rows[:, 2]}


def test_a_pair_keeps_its_two_rows_together_and_carries_one_task():
    mix = MixtureSequences([_Pairs(0, 3), _Pairs(1, 5)])
    batch = mix.get([4, 0, 7])
    assert batch["input_ids"].tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0], [0, 0, 1], [1, 4, 0], [1, 4, 1]]
    assert batch["pair_ids"].tolist() == [1, 0, 4] and batch["task"].tolist() == [1, 0, 1]
    assert batch["reference_logps"].tolist() == [10.0, 11.0, 0.0, 1.0, 40.0, 41.0]


@pytest.mark.parametrize("sources,expected", [
    ("[{name: a, path: x.txt, weight: -1}, {name: b, path: y.txt, weight: 1}]", "data.sources[0].weight=-1.0 must be >= 0"),
    ("[{name: a, path: x.txt, weight: 0}, {name: b, path: y.txt, weight: 0}]", "sum to zero"),
    ("[{name: a, path: x.txt, weight: 1}, {name: b, path: y.txt}]", "set a weight on every source, or on none"),
    ("[{name: a, path: x.txt}, {name: a, path: y.txt}]", "data.sources[1].name='a' names two sources"),
    ("[{name: 'a b', path: x.txt}]", "must be a name of letters, digits"),
    ("[{name: a, kind: hub, path: x}]", "data.sources[0].kind='hub' is not one of text, sft, tokens, preference"),
    ("[{name: a, kind: preference, path: x.json}, {name: b, kind: sft, path: y.json}]",
     "a mixture's sources are all kind=preference or none"),
    ("[{name: a}]", "data.sources[0].path must be set"),
    ("[]", "data.kind=mixture needs data.sources"),
])
def test_bad_sources_are_config_problems_naming_the_key(sources, expected):
    problems = C.validate(compose_config(["data=mixture", f"data.sources={sources}"]), 1)
    assert len([p for p in problems if expected in p]) == 1, problems


def test_sources_without_a_mixture_and_unknown_source_keys_are_refused():
    problems = C.validate(compose_config(["data=text", "data.path=x.txt", "data.sources=[{name: a, path: y}]"]), 1)
    assert any("data.sources is read with data.kind=mixture only" in p for p in problems)
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose_config(["data=mixture", "data.sources=[{name: a, path: y, wieght: 2}]"])


def test_build_data_mixes_a_text_and_an_sft_source(tmp_path):
    from models.tokenizer import embedded_tokenizer
    from trainer.data.datasets import build_data

    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    (tmp_path / "b.json").write_text(json.dumps([{"instruction": f"say {i}", "output": f"number {i}"}
                                                  for i in range(40)]))
    cfg = compose_config(["data=mixture", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=64",
                          f"data.sources=[{{name: text, kind: text, path: {tmp_path / 'a.txt'}}}, "
                          f"{{name: chat, kind: sft, path: {tmp_path / 'b.json'}}}]"])
    data = build_data(cfg, embedded_tokenizer(), 264, log=lambda m: None)
    assert data.tasks == ("text", "chat")
    sizes = [len(p) for p in data.train.parts]
    assert data.weights == tuple(float(n) for n in sizes)  # temperature 1: by size
    sampler = data.sampler(8, seed=0)
    batch = data.train.get(sampler.global_batch(0))
    assert sorted(batch["task"].tolist()) == sorted([0] * round(8 * sizes[0] / sum(sizes))
                                                    + [1] * round(8 * sizes[1] / sum(sizes)))
    assert len(data.val_of_task(1)) == len(data.val.parts[1]) and data.val_of_task(1).get([0])["task"].tolist() == [1]
    assert data.fingerprint.startswith("mix:") and "mixture of 2 sources by sizes" in data.description
