"""data=tokens (trainer/data/token_stores.py): training sequences over sharded token stores, the validation split
and the batch order as seeded bijections without index arrays, a bounded number of open shards, SFT stores, store
sources in a mixture, and stores that do not belong to the run refused."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from models.tokenizer import embedded_tokenizer
from trainer.config.schema import DataConfig, MixtureSource, TesseraConfig
from trainer.data import token_stores
from trainer.data.datasets import build_data
from trainer.data.tokenizing import Job, run
from tessera.errors import DataError

VOCAB = 264


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stores")
    rng = random.Random(0)
    words = ["lorem", "ipsum", "dolor", "sit", "amet"]
    (root / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(1, 200)))
                                                 for _ in range(150)), encoding="utf-8")
    cfg = TesseraConfig()
    cfg.data = DataConfig(kind="text", path=str(root / "corpus.txt"))
    manifest = run(Job(str(root / "store"), shard_bytes=8000), cfg, embedded_tokenizer(), VOCAB, log=lambda m: None)
    assert len(manifest["shards"]) >= 5
    return root / "store"


def _data(tmp_path, **data):
    cfg = TesseraConfig()
    cfg.data = DataConfig(cache_dir=str(tmp_path / "cache"), **data)
    return build_data(cfg, embedded_tokenizer(), VOCAB, log=lambda m: None)


def _rows(split, positions) -> list:
    batch = split.get(positions)
    return [tuple(r) for r in batch["input_ids"].tolist()]


def test_index_permutation_is_a_seeded_bijection_without_arrays():
    for n in (1, 2, 7, 1000, 65537):
        values = token_stores.IndexPermutation(n, ("a", 1))(np.arange(n))
        assert sorted(values.tolist()) == list(range(n))
    a = token_stores.IndexPermutation(1000, 1)(np.arange(1000))
    assert a.tolist() != token_stores.IndexPermutation(1000, 2)(np.arange(1000)).tolist()
    assert a.tolist() != list(range(1000))
    huge = token_stores.IndexPermutation(10 ** 12, 0)
    picked = huge(np.array([0, 1, 10 ** 12 - 1]))
    assert len(set(picked.tolist())) == 3 and all(0 <= v < 10 ** 12 for v in picked.tolist())


def test_sequences_are_the_store_windows_split_once_into_train_and_validation(tmp_path, store):
    data = _data(tmp_path, kind="tokens", path=str(store), seq_len=16, val_fraction=0.1)
    seqs = data.train.base
    assert isinstance(seqs, token_stores.ShardedSequences)
    manifest = json.loads((store / "manifest.json").read_text())
    windows = set()
    for i, shard in enumerate(manifest["shards"]):
        tokens = np.fromfile(store / "shards" / f"{shard['index']:05d}" / "tokens.bin", dtype=np.uint16)
        windows |= {tuple(tokens[j * 16:j * 16 + 16].tolist()) for j in range((len(tokens) - 1) // 16)}
    assert len(seqs) == sum((s["num_tokens"] - 1) // 16 for s in manifest["shards"])
    train, val = _rows(data.train, np.arange(len(data.train))), _rows(data.val, np.arange(len(data.val)))
    assert len(val) == round(0.1 * len(seqs)) and len(train) + len(val) == len(seqs)
    assert set(train) | set(val) <= windows and len(set(train) | set(val)) == len(windows)
    batch = data.train.get([0, 1])
    assert (batch["labels"][:, :-1] == batch["input_ids"][:, 1:]).all()
    assert "token store (text" in data.description and data.fingerprint.startswith("tokens:")


def test_the_batch_order_is_a_function_of_k_and_covers_each_epoch_once(tmp_path, store):
    data = _data(tmp_path, kind="tokens", path=str(store), seq_len=16, val_fraction=0.0)
    sampler = data.sampler(8, seed=3)
    assert isinstance(sampler, token_stores.LazyOrderSampler)
    epoch = np.concatenate([sampler.global_batch(k) for k in range(sampler.batches_per_epoch)])
    assert len(set(epoch.tolist())) == len(epoch) == sampler.batches_per_epoch * 8
    again = data.sampler(8, seed=3)
    k = sampler.batches_per_epoch + 2  # the next epoch, in another order
    assert again.global_batch(k).tolist() == sampler.global_batch(k).tolist()
    assert sampler.global_batch(k).tolist() != sampler.global_batch(2).tolist()
    halves = [sampler.micro_batches(5, r, 2, 2) for r in range(2)]
    assert np.concatenate([np.concatenate(h) for h in halves]).tolist() == sampler.global_batch(5).tolist()


def test_open_shards_stay_bounded(tmp_path, store, monkeypatch):
    monkeypatch.setattr(token_stores, "MAX_OPEN_SHARDS", 2)
    data = _data(tmp_path, kind="tokens", path=str(store), seq_len=16, val_fraction=0.0)
    everything = _rows(data.train, np.arange(len(data.train)))
    assert len(data.train.base._open) <= 2 and len(everything) == len(data.train)
    assert _rows(data.train, [3, 1, 2]) == [everything[3], everything[1], everything[2]]


def test_document_packing_and_sft_stores(tmp_path, store):
    packed = _data(tmp_path, kind="tokens", path=str(store), seq_len=64, val_fraction=0.0, packing="documents")
    batch = packed.train.get([0])
    assert "position_ids" in batch and int(batch["position_ids"][0, 0]) == 0
    records = [{"instruction": f"Say {i}", "output": f"{i}!" * (i % 3 + 1)} for i in range(24)]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = TesseraConfig()
    cfg.data = DataConfig(kind="sft", path=str(tmp_path / "s.jsonl"), cache_dir=str(tmp_path / "cache"),
                          val_fraction=0.0, seq_len=64)
    run(Job(str(tmp_path / "sft"), shard_records=5), cfg, embedded_tokenizer(), VOCAB, log=lambda m: None)
    from_store = _data(tmp_path, kind="tokens", path=str(tmp_path / "sft"), seq_len=64, val_fraction=0.0)
    direct = build_data(cfg, embedded_tokenizer(), VOCAB, log=lambda m: None)
    assert len(from_store.train) == len(direct.train) == 24
    rows = lambda split: sorted(tuple(r) for r in split.get(np.arange(24))["labels"].tolist())  # noqa: E731
    assert rows(from_store.train) == rows(direct.train)  # the same examples, the same trained tokens


def test_a_store_is_a_mixture_source_beside_text(tmp_path, store):
    (tmp_path / "other.txt").write_text("\n\n".join(f"doc {i} " * 20 for i in range(40)), encoding="utf-8")
    data = _data(tmp_path, kind="mixture", seq_len=16, val_fraction=0.1,
                 sources=[MixtureSource(name="store", kind="tokens", path=str(store), weight=1.0),
                          MixtureSource(name="plain", kind="text", path=str(tmp_path / "other.txt"), weight=1.0)])
    assert data.tasks == ("store", "plain")
    batch = data.train.get(data.sampler(8, 0).global_batch(0))
    assert batch["input_ids"].shape == (8, 16)


def test_stores_that_do_not_belong_to_the_run_are_refused(tmp_path, store):
    with pytest.raises(DataError, match="another tokenizer"):
        cfg = TesseraConfig()
        cfg.data = DataConfig(kind="tokens", path=str(store), cache_dir=str(tmp_path / "c"))
        tok = embedded_tokenizer()
        tok.add_tokens(["<extra>"])
        build_data(cfg, tok, VOCAB + 8, log=lambda m: None)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "plan.json").write_text("{}")
    with pytest.raises(DataError, match="no manifest.json .*--merge"):
        _data(tmp_path, kind="tokens", path=str(tmp_path / "half"))
    with pytest.raises(DataError, match="matches no token store"):
        _data(tmp_path, kind="tokens", path=str(tmp_path / "nothing-*"))


def test_a_damaged_store_is_one_message_and_the_tokenize_command_repairs_it(tmp_path, store):
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(store, copy)
    (copy / "shards" / "00001" / "tokens.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match="shard 1 of .* is damaged .*tokens.bin has 10 bytes"):
        _data(tmp_path, kind="tokens", path=str(copy))
    cfg = TesseraConfig()
    cfg.data = DataConfig(kind="text", path=str(store.parent / "corpus.txt"))
    notes = []
    run(Job(str(copy), shard_bytes=8000), cfg, embedded_tokenizer(), VOCAB, log=notes.append)
    assert any("shard 1 is damaged" in m for m in notes)
    assert len(_data(tmp_path, kind="tokens", path=str(copy), seq_len=16).train) > 0
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="manifest.json cannot be read"):
        _data(tmp_path, kind="tokens", path=str(copy))
