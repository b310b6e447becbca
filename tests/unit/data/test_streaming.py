"""trainer/data/streaming.py on files written by the test: the stream restarted at any saved position continues at
the exact token (across epoch boundaries too), each epoch trains every training record once in a new shard order,
held-out records never train, plain-text files are cut into shards of whole documents, the hub path streams, and a
bad record is one message naming it (raised where training reaches it, from the background reader)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from models.tokenizer import embedded_tokenizer
from tessera.errors import DataError
from trainer.data import sources, streaming
from trainer.data.streaming import Position, StreamData, StreamSource, TokenStream

SEQ = 16
WORDS = "the quick brown fox jumps over a lazy dog while rivers run to the sea and birds sing".split()


def _text(f: int, i: int) -> str:
    return f"doc {f}.{i}: " + " ".join(WORDS[(f * 7 + i + j) % len(WORDS)] for j in range(3 + (i * 5 + f) % 23))


def _jsonl_folder(root, files=5, records=12):
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        (root / f"part{f}.jsonl").write_text("".join(json.dumps({"text": _text(f, i)}) + "\n" for i in range(records)))
    return root


def _data(path, **kw):
    d = dict(kind="text", path=str(path), name=None, config_name=None, split="train", revision=None, text_field="text",
             seq_len=SEQ, val_fraction=0.0, split_seed=0, document_separator=None, max_document_chars=100_000,
             max_records=None, packing="eos", streaming=True)
    d.update(kw)
    return SimpleNamespace(**d)


@pytest.fixture(scope="module")
def tokenizer():
    return embedded_tokenizer()


def _record_tokens(tokenizer, text: str) -> list:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def _take(stream: TokenStream, batches: int, n: int = 3) -> list:
    return [stream.take(n, SEQ) for _ in range(batches)]


def test_a_stream_restarted_at_any_saved_position_continues_at_the_exact_token(tmp_path, tokenizer):
    source = StreamSource(_data(_jsonl_folder(tmp_path / "c", records=3)))
    reference = TokenStream(source, tokenizer, seed=3, split_seed=0, val_fraction=0.2)
    positions, windows = [], []
    for _ in range(60):  # several epochs: the corpus holds ~20 batches of training tokens
        positions.append(reference.position())
        windows.append(reference.take(3, SEQ))
    reference.close()
    assert {p.epoch for p in positions} >= {0, 1, 2}
    assert any(p.token > 0 for p in positions) and any(p.slot > 0 for p in positions)
    for at in (1, 7, 16, 23, 38, 55):
        resumed = TokenStream(source, tokenizer, seed=3, split_seed=0, val_fraction=0.2)
        resumed.start(positions[at])
        for k in range(at, min(at + 3, 60)):
            assert resumed.position() == positions[k] or k == at
            np.testing.assert_array_equal(resumed.take(3, SEQ), windows[k])
        resumed.close()
    # consecutive windows overlap by one token: every token after the first is a target once
    flat = np.concatenate([w for batch in windows for w in batch])
    assert all(batch[i][-1] == batch[i + 1][0] for batch in windows for i in range(2))
    assert len(flat) == 60 * 3 * (SEQ + 1)


def test_each_epoch_trains_every_training_record_once_in_a_new_shard_order(tmp_path, tokenizer):
    root = _jsonl_folder(tmp_path / "c", files=6, records=5)
    source = StreamSource(_data(root))
    assert source.num_shards == 6
    orders = [tuple(streaming.shard_order(6, 11, e)) for e in range(3)]
    assert len(set(orders)) == 3  # reshuffled each epoch, from the seed
    assert orders == [tuple(streaming.shard_order(6, 11, e)) for e in range(3)]
    seen, epoch0 = {}, []
    for position, pieces in streaming.training_records(source, 11, 0, 0.3, Position()):
        if position.epoch == 2:
            break
        seen.setdefault(position.epoch, []).append((int(orders[position.epoch][position.slot]), position.record))
        if position.epoch == 0:
            epoch0.append(" ".join(pieces))
    held = {(s, r) for s in range(6) for r in range(5) if streaming.held_out(0, s, r, 0.3)}
    train = {(s, r) for s in range(6) for r in range(5)} - held
    assert held and train
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == sorted(train)  # each training record once, no held-out record
        shards = [s for s, _ in seen[epoch]]
        assert list(dict.fromkeys(shards)) == [s for s in orders[epoch] if s in set(shards)]
    assert epoch0[0] == _text(seen[0][0][0], seen[0][0][1])


def test_validation_windows_come_from_held_out_records_only(tmp_path, tokenizer):
    root = _jsonl_folder(tmp_path / "c", files=2, records=40)
    data = StreamData(_data(root, val_fraction=0.25, split_seed=5), tokenizer, max_val_sequences=4)
    assert len(data.val) == 4
    held = [_record_tokens(tokenizer, _text(f, i)) for f in range(2) for i in range(40)
            if streaming.held_out(5, f, i, 0.25)]
    expected = np.concatenate([np.asarray(t) for t in held])[:4 * SEQ + 1]
    got = np.concatenate([data.val.rows[0]] + [row[1:] for row in data.val.rows[1:]])
    np.testing.assert_array_equal(got, expected)
    assert len(StreamData(_data(root), tokenizer, max_val_sequences=4).val) == 0  # val_fraction=0: none
    a = StreamData(_data(root, val_fraction=0.25, split_seed=5), tokenizer, 4).fingerprint
    assert a != StreamData(_data(root, val_fraction=0.25, split_seed=6), tokenizer, 4).fingerprint


def test_plain_text_files_are_cut_into_shards_of_whole_documents(tmp_path, tokenizer, monkeypatch):
    docs = [_text(0, i) for i in range(60)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs))
    monkeypatch.setattr(streaming, "SHARD_BYTES", 500)
    source = StreamSource(_data(tmp_path / "corpus.txt"))
    assert source.num_shards > 4
    read = [" ".join(p) for s in range(source.num_shards) for _, p in source.records(s)]
    assert read == docs  # whole documents, each once, in file order
    stream = TokenStream(source, tokenizer, seed=0, split_seed=0, val_fraction=0.0)
    tokens = sum(len(_record_tokens(tokenizer, t)) for t in docs)
    stream.take((tokens - 1) // SEQ, SEQ)  # one epoch's windows
    assert stream.position().epoch == 0
    stream.take(2, SEQ)
    assert stream.position().epoch == 1
    stream.close()


def test_parquet_shards_stream_and_resume_within_a_file(tmp_path, tokenizer):
    for f in range(2):
        pq.write_table(pa.table({"body": [_text(f, i) for i in range(30)]}), tmp_path / f"p{f}.parquet")
    source = StreamSource(_data(tmp_path, text_field="body"))
    assert source.num_shards == 2
    assert [i for i, _ in source.records(1, first=27)] == [27, 28, 29]
    stream = TokenStream(source, tokenizer, seed=1, split_seed=0, val_fraction=0.0)
    stream.take(5, SEQ)
    at, expected = stream.position(), stream.take(4, SEQ)
    again = TokenStream(source, tokenizer, seed=1, split_seed=0, val_fraction=0.0)
    again.start(at)
    np.testing.assert_array_equal(again.take(4, SEQ), expected)


def test_compressed_jsonl_shards_stream_as_the_plain_ones(tmp_path, tokenizer):
    import gzip

    plain = _jsonl_folder(tmp_path / "plain", files=2, records=9)
    packed = tmp_path / "packed"
    packed.mkdir()
    for f in sorted(plain.glob("*.jsonl")):
        (packed / (f.name + ".gz")).write_bytes(gzip.compress(f.read_bytes()))
    streams = [TokenStream(StreamSource(_data(root)), tokenizer, seed=1, split_seed=0, val_fraction=0.0)
               for root in (plain, packed)]
    assert streams[1].source.num_shards == 2
    np.testing.assert_array_equal(streams[1].take(6, SEQ), streams[0].take(6, SEQ))


def test_a_compressed_text_file_is_one_shard_read_whole(tmp_path, tokenizer, monkeypatch):
    import gzip

    monkeypatch.setattr(streaming, "SHARD_BYTES", 64)  # the plain file: several byte ranges
    text = "".join(_text(0, i) + "\n\n" for i in range(20))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "c.txt").write_text(text)
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(text.encode()))
    plain, packed = StreamSource(_data(tmp_path / "plain")), StreamSource(_data(tmp_path / "c.txt.gz"))
    assert plain.num_shards > 1 and packed.num_shards == 1
    documents = [" ".join(p) for shard in range(plain.num_shards) for _, p in plain.records(shard)]
    assert [" ".join(p) for _, p in packed.records(0)] == documents == [_text(0, i) for i in range(20)]
    assert [i for i, _ in packed.records(0, first=17)] == [17, 18, 19]  # a resume inside the file


def test_a_hub_dataset_is_read_through_datasets_streaming(tmp_path, tokenizer, monkeypatch):
    root = _jsonl_folder(tmp_path / "hub", files=3, records=4)
    calls = []
    real = __import__("datasets").load_dataset

    def load_dataset(name, config_name=None, split=None, revision=None, streaming=False):
        calls.append((name, config_name, split, revision, streaming))
        return real("json", data_files=sorted(str(p) for p in root.glob("*.jsonl")), split="train",
                    streaming=streaming)

    monkeypatch.setattr("datasets.load_dataset", load_dataset)
    source = StreamSource(_data(None, kind="hub", name="org/corpus", revision="v1"))
    assert calls == [("org/corpus", None, "train", "v1", True)] and source.num_shards == 3
    texts = [" ".join(p) for s in range(3) for _, p in source.records(s)]
    assert texts == [_text(f, i) for f in range(3) for i in range(4)]


def test_a_bad_record_is_one_message_raised_where_training_reaches_it(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps({"text": _text(0, i)}) + "\n" for i in range(20)) + json.dumps({"text": 7}) + "\n")
    stream = TokenStream(StreamSource(_data(path)), tokenizer, seed=0, split_seed=0, val_fraction=0.0)
    with pytest.raises(DataError, match=r"record 20 of shard 0 has a int, not text, in field 'text'"):
        stream.take(40, SEQ)
    with pytest.raises(DataError):  # asked again: the same error, no hang
        stream.take(1, SEQ)
    stream.close()


def test_a_source_with_no_training_record_is_an_error_not_a_hang(tmp_path, tokenizer):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n")
    stream = TokenStream(StreamSource(_data(path)), tokenizer, seed=0, split_seed=0, val_fraction=0.0)
    with pytest.raises(DataError, match="found no training record"):
        stream.take(1, SEQ)


def test_the_sampler_state_is_the_position_before_an_untrained_step(tmp_path, tokenizer):
    data = StreamData(_data(_jsonl_folder(tmp_path / "c")), tokenizer, 0)
    sampler = data.sampler(4, seed=2)
    assert sampler.state_dict(0)["stream"] == Position().as_dict()
    first = sampler.global_batch(0)
    rows = data.train.rows.copy()
    assert np.array_equal(sampler.global_batch(0), first) and np.array_equal(data.train.rows, rows)  # idempotent
    assert sampler.state_dict(0)["stream"] == Position().as_dict()  # taken, not trained
    moved = sampler.state_dict(1)["stream"]
    assert moved["token"] == 4 * SEQ or moved["record"] > 0
    other = data.sampler(4, seed=2)
    other.load_state_dict(sampler.state_dict(1))
    sampler.global_batch(1)
    other.global_batch(1)
    np.testing.assert_array_equal(data.train.rows, data.train.rows)
    with pytest.raises(DataError, match="no stream position"):
        other.load_state_dict({"consumed_batches": 3})


def test_rank_slices_of_a_global_batch_do_not_depend_on_the_world_size(tmp_path, tokenizer):
    data = StreamData(_data(_jsonl_folder(tmp_path / "c")), tokenizer, 0)
    sampler = data.sampler(8, seed=0)
    whole = np.concatenate(sampler.micro_batches(0, 0, 1, 8))
    halves = [np.concatenate(sampler.micro_batches(0, r, 2, 2)) for r in range(2)]
    assert np.array_equal(np.concatenate(halves), whole)


def test_streaming_config_problems(tmp_path):
    def cfg(**data):
        d = dict(streaming=True, kind="text", follow=False, packing="eos", max_records=None, val_fraction=0.05)
        d.update(data)
        return SimpleNamespace(data=SimpleNamespace(**d), strategy=SimpleNamespace(fault_tolerance="none"),
                               eval=SimpleNamespace(max_sequences=64))

    assert streaming.streaming_problems(cfg()) == []
    assert streaming.streaming_problems(cfg(streaming=False, kind="sft")) == []
    assert "python -m trainer.tokenize" in streaming.streaming_problems(cfg(kind="sft"))[0]
    assert "choose one" in streaming.streaming_problems(cfg(follow=True))[0]
    assert "data.packing=eos" in streaming.streaming_problems(cfg(packing="documents"))[0]
    assert "data.max_records" in streaming.streaming_problems(cfg(max_records=10))[0]
    c = cfg()
    c.eval.max_sequences = 0
    assert "no end on a stream" in streaming.streaming_problems(c)[0]
    assert sources.file_kind("a.parquet") == "parquet"


def test_a_file_that_does_not_parse_is_one_message_without_the_readers_own_log(tmp_path, tokenizer, capfd):
    path = tmp_path / "broken.jsonl"
    path.write_text("".join(json.dumps({"text": _text(0, i)}) + "\n" for i in range(5)) + '{"text": "unterminated\n')
    stream = TokenStream(StreamSource(_data(path)), tokenizer, seed=0, split_seed=0, val_fraction=0.0)
    with pytest.raises(DataError, match=r"data.path=.*: cannot read shard 0: JSON parse error"):
        stream.take(40, SEQ)
    stream.close()
    assert "Failed to load JSON" not in capfd.readouterr().err
