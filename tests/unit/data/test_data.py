"""The data pipeline: packing, local text/JSONL sources and their errors, the tokenization cache (including
concurrent builders), the train/validation split, and SFT masking (alpaca and chat records)."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from models.tokenizer import EOS_TOKEN, embedded_tokenizer
from trainer.config.schema import DataConfig, ModelConfig, TesseraConfig
from trainer.data.datasets import IGNORE, PackedSequences, SFTSequences, build_data
from trainer.data.store import TokenStore, build_or_load
from trainer.data.sft import DEFAULT_CHAT_TEMPLATE
from tessera.errors import DataError

import cache_worker  # tests/unit/data/cache_worker.py: the spawned processes import it, not this heavier module

VOCAB = 264  # the embedded tokenizer's 258 tokens padded to a multiple of 8, as the presets do
EOS = 256


@pytest.fixture(scope="module")
def tok():
    return embedded_tokenizer()


def _cfg(tmp_path, **data) -> TesseraConfig:
    cfg = TesseraConfig()
    data.setdefault("cache_dir", str(tmp_path / "cache"))
    data.setdefault("val_fraction", 0.0)
    cfg.data = DataConfig(**data)
    return cfg


def _logs():
    messages = []
    return messages, messages.append


def _cache_entries(cache_dir) -> list:
    return sorted(p.name for p in Path(cache_dir).iterdir() if p.is_dir())


def _write_jsonl(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------------------------------------
# Packing over a token store

def _docs():
    return [np.arange(1, 8), np.arange(20, 25), np.arange(40, 52)]  # 7 + 5 + 12 = 24 tokens


def _store(tmp_path, docs, kind="text", vocab=VOCAB, log=None):
    return build_or_load(str(tmp_path / "cache"), {"test": "docs"}, kind, vocab,
                         lambda: ((d, None) for d in docs), log or (lambda m: None))


def test_token_store_round_trip(tmp_path):
    store = _store(tmp_path, _docs())
    assert isinstance(store, TokenStore)
    assert store.meta["num_tokens"] == 24 and store.meta["num_documents"] == 3
    assert store.tokens.dtype == np.uint16
    np.testing.assert_array_equal(store.tokens, np.concatenate(_docs()))
    assert store.mask is None
    np.testing.assert_array_equal(store.offsets, np.cumsum([0] + [len(d) for d in _docs()]))


def test_packed_windows_overlap_by_one_and_labels_shift(tmp_path):
    store = _store(tmp_path, _docs())
    stream = np.concatenate(_docs())
    seqs = PackedSequences(store, seq_len=5)
    assert len(seqs) == (24 - 1) // 5 == 4
    batch = seqs.get([0, 1, 2, 3])
    ids, labels = batch["input_ids"].numpy(), batch["labels"].numpy()
    assert ids.shape == labels.shape == (4, 5)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    for i in range(4):
        np.testing.assert_array_equal(ids[i], stream[5 * i:5 * i + 5])
        np.testing.assert_array_equal(labels[i], stream[5 * i + 1:5 * i + 6])  # next token everywhere
        if i:
            assert ids[i][0] == labels[i - 1][-1]  # window i starts where window i-1's last target was
    assert (labels != IGNORE).all()
    assert seqs.count_targets([0, 2]) == 10
    # a subset in any order
    np.testing.assert_array_equal(seqs.get([3, 1])["input_ids"].numpy(), ids[[3, 1]])


def test_out_of_vocabulary_token_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        _store(tmp_path, [np.array([1, 2, 300])], vocab=300)
    assert _cache_entries(tmp_path / "cache") == []  # nothing half-written stays behind


def test_empty_source_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no tokens"):
        _store(tmp_path, [])
    assert _cache_entries(tmp_path / "cache") == []


def test_large_vocab_uses_uint32(tmp_path):
    store = _store(tmp_path, [np.array([70000, 5])], vocab=100000)
    assert store.tokens.dtype == np.uint32
    np.testing.assert_array_equal(store.tokens, [70000, 5])


# ---------------------------------------------------------------------------------------------------------
# Local text sources through build_data

def _stream(data) -> np.ndarray:
    return np.asarray(data.train.base.tokens, dtype=np.int64)


def test_text_files_are_documents_separated_by_eos(tmp_path, tok):
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("Hello world.\nSecond line\n", encoding="utf-8")
    (tmp_path / "txt" / "b.txt").write_text("Zweite Datei \u00fc", encoding="utf-8")
    cfg = _cfg(tmp_path, kind="text", path=str(tmp_path / "txt"), seq_len=4)
    data = build_data(cfg, tok, VOCAB, log=lambda m: None)
    a = list("Hello world.\nSecond line\n".encode())
    b = list("Zweite Datei \u00fc".encode())
    np.testing.assert_array_equal(_stream(data), a + [EOS] + b + [EOS])
    assert data.num_tokens == len(a) + len(b) + 2
    assert len(data.train) == (data.num_tokens - 1) // 4 and len(data.val) == 0
    assert "2 documents" in data.description


def test_jsonl_records_are_documents_separated_by_eos(tmp_path, tok):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": "one", "id": 1}, {"text": "", "id": 2},
                                                 {"text": "two \u2713", "id": 3}])
    data = build_data(_cfg(tmp_path, kind="text", path=path, seq_len=2), tok, VOCAB, log=lambda m: None)
    expected = list(b"one") + [EOS] + list("two \u2713".encode()) + [EOS]  # the empty record is skipped
    np.testing.assert_array_equal(_stream(data), expected)


def _compress(path: Path, suffix: str) -> str:
    """`path`'s bytes compressed as `suffix` says, beside it."""
    import bz2
    import gzip
    import lzma

    import zstandard

    raw = path.read_bytes()
    packed = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
              ".zst": zstandard.ZstdCompressor().compress}[suffix](raw)
    out = Path(str(path) + suffix)
    out.write_bytes(packed)
    return str(out)


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
def test_compressed_jsonl_and_json_read_as_the_plain_files(tmp_path, tok, suffix):
    records = [{"text": f"record {i} \u2713 " * (1 + i % 3)} for i in range(7)]
    plain = _write_jsonl(tmp_path / "c.jsonl", records)
    (tmp_path / "a.json").write_text(json.dumps(records))
    expected = _stream(build_data(_cfg(tmp_path, kind="text", path=plain, seq_len=4), tok, VOCAB, log=lambda m: None))
    for packed in (_compress(tmp_path / "c.jsonl", suffix), _compress(tmp_path / "a.json", suffix)):
        data = build_data(_cfg(tmp_path, kind="text", path=packed, seq_len=4), tok, VOCAB, log=lambda m: None)
        np.testing.assert_array_equal(_stream(data), expected)


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
def test_compressed_plain_text_reads_as_the_plain_file(tmp_path, tok, suffix):
    (tmp_path / "c.txt").write_text("".join(f"document {i} \u2713 " * (1 + i % 4) + "\n\n" for i in range(9)))
    expected = _stream(build_data(_cfg(tmp_path, kind="text", path=str(tmp_path / "c.txt"), seq_len=4), tok, VOCAB,
                                  log=lambda m: None))
    packed = _compress(tmp_path / "c.txt", suffix)
    data = build_data(_cfg(tmp_path, kind="text", path=packed, seq_len=4), tok, VOCAB, log=lambda m: None)
    np.testing.assert_array_equal(_stream(data), expected)
    assert "9 documents" in data.description


def test_compressed_bytes_under_a_plain_name_say_so(tmp_path, tok):
    (tmp_path / "c.txt").write_text("one\n\ntwo\n")
    packed = Path(_compress(tmp_path / "c.txt", ".zst"))
    packed.rename(tmp_path / "d.txt")
    with pytest.raises(DataError, match=r"not UTF-8 text .*; it is zst-compressed: name it d\.txt\.zst"):
        build_data(_cfg(tmp_path, kind="text", path=str(tmp_path / "d.txt"), seq_len=2), tok, VOCAB,
                   log=lambda m: None)


def test_a_truncated_compressed_file_is_a_data_error(tmp_path, tok):
    (tmp_path / "c.txt").write_text("\n\n".join(f"document {i * 7919 % 10007}" for i in range(2000)))
    packed = Path(_compress(tmp_path / "c.txt", ".gz"))
    packed.write_bytes(packed.read_bytes()[:len(packed.read_bytes()) // 2])
    with pytest.raises(DataError, match=r"cannot read .*c\.txt\.gz: "):
        build_data(_cfg(tmp_path, kind="text", path=str(packed), seq_len=2), tok, VOCAB, log=lambda m: None)


def test_jsonl_custom_text_field_and_max_records(tmp_path, tok):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"body": "aaa"}, {"body": "bbb"}, {"body": "ccc"}])
    data = build_data(_cfg(tmp_path, kind="text", path=path, seq_len=2, text_field="body", max_records=2),
                      tok, VOCAB, log=lambda m: None)
    np.testing.assert_array_equal(_stream(data), list(b"aaa") + [EOS] + list(b"bbb") + [EOS])


def test_jsonl_missing_text_field_names_the_field(tmp_path, tok):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"content": "x"}, {"content": "y"}])
    with pytest.raises(DataError) as info:
        build_data(_cfg(tmp_path, kind="text", path=path, seq_len=2), tok, VOCAB, log=lambda m: None)
    msg = str(info.value)
    assert "'text'" in msg and "data.text_field" in msg and "content" in msg


def test_jsonl_record_without_value_names_record_and_field(tmp_path, tok):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": "x"}, {"other": 1}])
    with pytest.raises(DataError, match=r"record 1 has no value in field 'text'"):
        build_data(_cfg(tmp_path, kind="text", path=path, seq_len=2), tok, VOCAB, log=lambda m: None)


def test_jsonl_whose_field_changes_type_names_the_row(tmp_path, tok):
    # pyarrow's error says where; datasets' pandas fallback ("Expected object or value") does not
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "x"}\n\n{"text": null}\n{"text": 5}\n{"text": "y"}\n')  # a blank line: pandas' turn
    with pytest.raises(DataError, match=r"cannot read .*c\.jsonl: .*changed from string to number in row \d"):
        build_data(_cfg(tmp_path, kind="text", path=str(path), seq_len=2), tok, VOCAB, log=lambda m: None)


def test_jsonl_non_text_value_is_a_data_error(tmp_path, tok):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": 5}, {"text": 6}])
    with pytest.raises(DataError, match="not text"):
        build_data(_cfg(tmp_path, kind="text", path=path, seq_len=2), tok, VOCAB, log=lambda m: None)


def test_empty_file_is_a_data_error(tmp_path, tok):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="is empty"):
        build_data(_cfg(tmp_path, kind="text", path=str(tmp_path / "empty.txt")), tok, VOCAB)


def test_missing_path_is_a_data_error(tmp_path, tok):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="no such file or folder") as info:
        build_data(_cfg(tmp_path, kind="text", path=missing), tok, VOCAB)
    assert missing in str(info.value)


def test_glob_without_matches_and_bad_extension(tmp_path, tok):
    with pytest.raises(DataError, match="matches no files"):
        build_data(_cfg(tmp_path, kind="text", path=str(tmp_path / "*.txt")), tok, VOCAB)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported extension"):
        build_data(_cfg(tmp_path, kind="text", path=str(tmp_path / "x.csv")), tok, VOCAB)


def test_mixed_file_types_are_a_data_error(tmp_path, tok):
    (tmp_path / "a.txt").write_text("hello")
    _write_jsonl(tmp_path / "b.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match="mixes file types"):
        build_data(_cfg(tmp_path, kind="text", path=f"{tmp_path / 'a.txt'},{tmp_path / 'b.jsonl'}"), tok, VOCAB)


def test_too_little_data_for_seq_len(tmp_path, tok):
    (tmp_path / "a.txt").write_text("tiny")
    with pytest.raises(DataError, match="too few to train on"):
        build_data(_cfg(tmp_path, kind="text", path=str(tmp_path / "a.txt"), seq_len=64), tok, VOCAB)


def test_train_validation_split(tmp_path, tok):
    (tmp_path / "a.txt").write_text("abcdefghij" * 50)  # 501 tokens -> 125 sequences of 4
    path = str(tmp_path / "a.txt")
    data = build_data(_cfg(tmp_path, kind="text", path=path, seq_len=4, val_fraction=0.2), tok, VOCAB,
                      log=lambda m: None)
    train, val = data.train.indices, data.val.indices
    assert (len(train), len(val)) == (100, 25)
    assert set(train.tolist()).isdisjoint(val.tolist())
    assert sorted(train.tolist() + val.tolist()) == list(range(125))
    same = build_data(_cfg(tmp_path, kind="text", path=path, seq_len=4, val_fraction=0.2), tok, VOCAB)
    np.testing.assert_array_equal(same.val.indices, val)
    other = build_data(_cfg(tmp_path, kind="text", path=path, seq_len=4, val_fraction=0.2, split_seed=1), tok,
                       VOCAB)
    assert not np.array_equal(other.val.indices, val)
    assert other.fingerprint != data.fingerprint
    # the subset view reads the right base sequences
    base = data.train.base.get(train[[0, 5]])
    view = data.train.get([0, 5])
    np.testing.assert_array_equal(view["input_ids"], base["input_ids"])


def test_embedded_corpus(tmp_path, tok):
    cfg = _cfg(tmp_path, kind="embedded", embedded_documents=20, seq_len=32, val_fraction=0.1)
    data = build_data(cfg, tok, VOCAB, log=lambda m: None)
    stream = _stream(data)
    assert (stream == EOS).sum() == 20 and stream[-1] == EOS
    assert tok.decode(stream[:stream.tolist().index(EOS)]).endswith(".")
    assert len(data.val) >= 1 and len(data.train) + len(data.val) == (len(stream) - 1) // 32


# ---------------------------------------------------------------------------------------------------------
# The tokenization cache

def test_second_build_reads_the_cache(tmp_path, tok):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": "hello there"}, {"text": "general kenobi"}])
    cfg = _cfg(tmp_path, kind="text", path=path, seq_len=4)
    logs, log = _logs()
    first = build_data(cfg, tok, VOCAB, log=log)
    entries = _cache_entries(cfg.data.cache_dir)
    assert len(entries) == 1
    meta = Path(cfg.data.cache_dir) / entries[0] / "meta.json"
    tokens_file = Path(cfg.data.cache_dir) / entries[0] / "tokens.bin"
    mtimes = (meta.stat().st_mtime_ns, tokens_file.stat().st_mtime_ns)
    time.sleep(0.01)
    second = build_data(cfg, tok, VOCAB, log=log)
    assert sum(m.startswith("tokenized") for m in logs) == 1, logs
    assert (meta.stat().st_mtime_ns, tokens_file.stat().st_mtime_ns) == mtimes
    assert _cache_entries(cfg.data.cache_dir) == entries
    np.testing.assert_array_equal(_stream(first), _stream(second))
    assert first.fingerprint == second.fingerprint


def test_changed_file_or_tokenizer_gets_a_new_entry(tmp_path, tok):
    p = tmp_path / "c.jsonl"
    path = _write_jsonl(p, [{"text": "hello there"}])
    cfg = _cfg(tmp_path, kind="text", path=path, seq_len=2)
    logs, log = _logs()
    build_data(cfg, tok, VOCAB, log=log)
    _write_jsonl(p, [{"text": "hello there, again"}])
    changed = build_data(cfg, tok, VOCAB, log=log)
    assert tok.decode(_stream(changed)[:-1]) == "hello there, again"
    other_tok = embedded_tokenizer()
    other_tok.chat_template = "{{ messages }}"  # part of the tokenizer's fingerprint
    build_data(cfg, other_tok, VOCAB, log=log)
    assert sum(m.startswith("tokenized") for m in logs) == 3
    assert len(_cache_entries(cfg.data.cache_dir)) == 3


def test_concurrent_builds_make_one_entry(tmp_path):
    cache_dir = str(tmp_path / "cache")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=cache_worker.build_concurrently, args=(cache_dir, barrier, results))
             for _ in range(3)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=90) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
    errors = [logs for _, path, _, logs in got if path is None]
    assert not errors, errors
    assert all(p.exitcode == 0 for p in procs)
    assert len({pid for pid, *_ in got}) == 3
    paths = {path for _, path, _, _ in got}
    assert len(paths) == 1
    expected = cache_worker.expected_tokens()
    assert all(tokens == expected for _, _, tokens, _ in got)
    built = [logs for *_, logs in got if any(m.startswith("tokenized") for m in logs)]
    assert len(built) == 1, [logs for *_, logs in got]  # one process tokenized, the others waited and read
    names = sorted(os.listdir(cache_dir))
    entry = Path(paths.pop()).name
    assert names == [entry, entry + ".lock"]  # no temporary folder is left behind


# ---------------------------------------------------------------------------------------------------------
# SFT

ALPACA = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "The sum is 5."},
    {"instruction": "Greet.", "input": "", "output": "Hello, \u00e9l\u00e8ve!", "system": "Be kind."},
]


def _alpaca_prompt(rec) -> str:
    """The prompt Tessera's default chat template renders for an alpaca record, written out independently."""
    user = rec["instruction"] if not rec.get("input") else f"{rec['instruction']}\n\n{rec['input']}"
    system = f"<|system|>\n{rec['system']}\n" if rec.get("system") else ""
    return f"{system}<|user|>\n{user}\n<|assistant|>\n"


def _labelled_runs(labels: np.ndarray) -> list:
    """Maximal runs of consecutive labelled positions -> list of arrays of label ids."""
    pos = np.nonzero(labels != IGNORE)[0]
    if not len(pos):
        return []
    cuts = np.nonzero(np.diff(pos) != 1)[0] + 1
    return [labels[r] for r in np.split(pos, cuts)]


@pytest.fixture
def alpaca_data(tmp_path, tok):
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(ALPACA), encoding="utf-8")
    data = build_data(_cfg(tmp_path, kind="sft", path=str(path), seq_len=128), tok, VOCAB, log=lambda m: None)
    return data.train.base


def test_sft_default_chat_template_is_installed(tmp_path, tok):
    t = embedded_tokenizer()
    assert not t.chat_template
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(ALPACA))
    build_data(_cfg(tmp_path, kind="sft", path=str(path), seq_len=128), t, VOCAB, log=lambda m: None)
    assert t.chat_template == DEFAULT_CHAT_TEMPLATE


def test_sft_masks_the_prompt_and_trains_the_response(alpaca_data, tok):
    seqs = alpaca_data
    assert isinstance(seqs, SFTSequences) and len(seqs) == 3 and seqs.dropped == 0
    for i in range(3):
        rec = ALPACA[seqs.keep[i]]
        batch = seqs.get([i])
        ids, labels = batch["input_ids"][0].numpy(), batch["labels"][0].numpy()
        n_prompt = len(_alpaca_prompt(rec).encode("utf-8"))  # byte-level: one token per byte
        assert tok.decode(ids[:n_prompt]) == _alpaca_prompt(rec)
        assert (labels[:n_prompt - 1] == IGNORE).all()  # no prompt token is a target
        assert labels[n_prompt - 1] == ids[n_prompt] == rec["output"].encode()[0]  # the first response token is
        runs = _labelled_runs(labels)
        assert len(runs) == 1
        text = tok.decode(runs[0])
        assert text.startswith(rec["output"] + EOS_TOKEN), text
        assert text[len(rec["output"] + EOS_TOKEN):].strip() == ""  # at most the template's turn separator
        assert seqs.count_targets([i]) == int((labels != IGNORE).sum())
        # padding after the example never carries loss
        length = int(seqs.offsets[seqs.keep[i] + 1] - seqs.offsets[seqs.keep[i]])
        assert (labels[length - 1:] == IGNORE).all() and (ids[length:] == tok.pad_token_id).all()


def test_sft_trains_exactly_response_and_eos(alpaca_data, tok):
    for i in range(len(alpaca_data)):
        rec = ALPACA[alpaca_data.keep[i]]
        labels = alpaca_data.get([i])["labels"][0].numpy()
        assert tok.decode(labels[labels != IGNORE]) == rec["output"] + EOS_TOKEN


def test_sft_truncation_keeps_examples_with_a_response_token(tmp_path, tok):
    path = tmp_path / "alpaca.json"
    long_prompt = {"instruction": "x" * 200, "input": "", "output": "ok"}
    path.write_text(json.dumps([long_prompt, ALPACA[0], ALPACA[2]]))
    logs, log = _logs()
    # ALPACA[0]'s prompt is 38 tokens: with seq_len 40 its window holds 3 response tokens ("Blu")
    data = build_data(_cfg(tmp_path, kind="sft", path=str(path), seq_len=40), tok, VOCAB, log=log)
    seqs = data.train.base
    assert seqs.dropped == 2 and list(seqs.keep) == [1]
    assert any("2 SFT examples have no response token" in m for m in logs)
    labels = seqs.get([0])["labels"][0].numpy()
    assert tok.decode(labels[labels != IGNORE]) == "Blu"
    assert seqs.count_targets([0]) == 3


def test_sft_no_example_fits_is_a_data_error(tmp_path, tok):
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps([{"instruction": "x" * 200, "input": "", "output": "ok"}]))
    with pytest.raises(DataError, match="raise data.seq_len"):
        build_data(_cfg(tmp_path, kind="sft", path=str(path), seq_len=40), tok, VOCAB, log=lambda m: None)


CHAT = [
    {"messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Six, of course."},
    ]},
    {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]},
]


def test_sft_chat_trains_every_assistant_turn_and_no_user_turn(tmp_path, tok):
    path = _write_jsonl(tmp_path / "chat.jsonl", CHAT)
    data = build_data(_cfg(tmp_path, kind="sft", path=path, seq_len=256), tok, VOCAB, log=lambda m: None)
    seqs = data.train.base
    assert len(seqs) == 2
    for i in range(2):
        messages = CHAT[seqs.keep[i]]["messages"]
        labels = seqs.get([i])["labels"][0].numpy()
        runs = [tok.decode(r) for r in _labelled_runs(labels)]
        assistant = [m["content"] for m in messages if m["role"] == "assistant"]
        assert len(runs) == len(assistant)
        for run, content in zip(runs, assistant):
            assert run.startswith(content + EOS_TOKEN), run
            assert run[len(content + EOS_TOKEN):].strip() == ""
        labelled = "".join(runs)
        for m in messages:
            if m["role"] != "assistant":
                assert m["content"] not in labelled
        assert "<|user|>" not in labelled and "<|assistant|>" not in labelled
        assert seqs.count_targets([i]) == int((labels != IGNORE).sum())


ASSISTANT_FIRST = [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Who are you?"},
                   {"role": "assistant", "content": "A test."}]


@pytest.fixture
def assistant_first(tmp_path, tok):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": ASSISTANT_FIRST}])
    data = build_data(_cfg(tmp_path, kind="sft", path=path, seq_len=128), tok, VOCAB, log=lambda m: None)
    seqs = data.train.base
    batch = seqs.get([0])
    return seqs, batch["input_ids"][0].numpy(), batch["labels"][0].numpy()


def test_sft_chat_starting_with_an_assistant_turn(assistant_first, tok):
    """The example's first token has nothing to predict it: it is never a target, and the target count used
    for loss normalization agrees with the labels."""
    seqs, ids, labels = assistant_first
    assert tok.decode(ids[:len("<|assistant|>\nHi!")]) == "<|assistant|>\nHi!"
    runs = [tok.decode(r) for r in _labelled_runs(labels)]
    assert len(runs) == 2
    assert runs[0].rstrip().endswith("Hi!" + EOS_TOKEN) and runs[1].startswith("A test." + EOS_TOKEN)
    assert "Who are you?" not in "".join(runs)
    assert seqs.count_targets([0]) == int((labels != IGNORE).sum())


def test_sft_assistant_first_turn_header_is_not_trained(assistant_first, tok):
    seqs, ids, labels = assistant_first
    runs = [tok.decode(r) for r in _labelled_runs(labels)]
    assert runs[0].startswith("Hi!" + EOS_TOKEN), runs[0]


def test_sft_chat_without_assistant_turn_is_a_data_error(tmp_path, tok):
    path = _write_jsonl(tmp_path / "chat.jsonl",
                        [CHAT[1], {"messages": [{"role": "user", "content": "anyone there?"}]}])
    with pytest.raises(DataError, match="record 1 has no assistant message"):
        build_data(_cfg(tmp_path, kind="sft", path=path, seq_len=256), tok, VOCAB, log=lambda m: None)
    assert _cache_entries(tmp_path / "cache") == []


def test_sft_records_of_unknown_shape(tmp_path, tok):
    path = _write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match="'instruction' and 'output'"):
        build_data(_cfg(tmp_path, kind="sft", path=path, seq_len=64), tok, VOCAB, log=lambda m: None)
    (tmp_path / "a.txt").write_text("plain")
    with pytest.raises(DataError, match="must be JSON"):
        build_data(_cfg(tmp_path, kind="sft", path=str(tmp_path / "a.txt"), seq_len=64), tok, VOCAB)
    path = _write_jsonl(tmp_path / "y.jsonl", [{"instruction": "q", "output": ""}])
    with pytest.raises(DataError, match="non-empty 'output'"):
        build_data(_cfg(tmp_path, kind="sft", path=path, seq_len=64), tok, VOCAB, log=lambda m: None)


@pytest.fixture(scope="module")
def stories_alpaca(shared_data, tmp_path_factory):
    """The real alpaca demo records tokenized with the real stories260K tokenizer (built once per module)."""
    from models import registry

    shared = shared_data

    m = ModelConfig(kind="hf", name_or_path=str(shared / "models" / "stories260K-hf"), tokenizer=None)
    tokenizer = registry.load_tokenizer(m)
    info = registry.describe(m, tokenizer)
    cfg = TesseraConfig(model=m, data=DataConfig(kind="sft", path=str(shared / "datasets" / "alpaca_en_demo.json"),
                                                 seq_len=512, val_fraction=0.0,
                                                 cache_dir=str(tmp_path_factory.mktemp("sft-cache"))))
    data = build_data(cfg, tokenizer, info.vocab_size, log=lambda msg: None)
    records = json.loads((shared / "datasets" / "alpaca_en_demo.json").read_text(encoding="utf-8"))
    return tokenizer, data.train.base, records


def test_sft_real_alpaca_never_trains_on_prompt_tokens(stories_alpaca):
    tokenizer, seqs, records = stories_alpaca
    assert len(records) == 999 and len(seqs) + seqs.dropped == 999
    assert len(seqs) > 900
    L = seqs.seq_len
    for start in range(0, len(seqs), 128):
        idx = list(range(start, min(start + 128, len(seqs))))
        batch = seqs.get(idx)
        ids_all, labels_all = batch["input_ids"].numpy(), batch["labels"].numpy()
        for row, i in enumerate(idx):
            rec = records[seqs.keep[i]]
            prompt_ids = tokenizer(_alpaca_prompt(rec), add_special_tokens=False)["input_ids"]
            n = len(prompt_ids)
            ids, labels = ids_all[row], labels_all[row]
            assert n <= L, i  # kept examples have room for a response token
            np.testing.assert_array_equal(ids[:n], prompt_ids)  # the prompt renders as written out above
            assert (labels[:n - 1] == IGNORE).all(), (i, rec["instruction"][:40])
            assert labels[n - 1] != IGNORE  # training starts exactly at the first response token
            assert int((labels != IGNORE).sum()) == seqs.count_targets([i])


# ---------------------------------------------------------------------------------------------------------
# SFT records from a hub dataset by name (data=sft data.name=...; data.path wins when both are set)

def _fake_hub(monkeypatch, records):
    """datasets.load_dataset answering for the hub: the records, and every call's arguments."""
    import datasets

    calls = []

    def load_dataset(name, config_name=None, split=None, revision=None, **kw):
        calls.append((name, config_name, split, revision))
        return datasets.Dataset.from_list(records)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_sft_from_a_hub_dataset_by_name(tmp_path, tok, monkeypatch):
    from trainer.data import sources

    calls = _fake_hub(monkeypatch, ALPACA)
    cfg = _cfg(tmp_path, kind="sft", name="org/alpaca", split="train[:3]", revision="v1", seq_len=128)
    seqs = build_data(cfg, tok, VOCAB, log=lambda m: None).train.base
    assert calls == [("org/alpaca", None, "train[:3]", "v1")]
    assert isinstance(seqs, SFTSequences) and len(seqs) == 3
    labels = seqs.get([0])["labels"][0].numpy()
    assert tok.decode(labels[labels != IGNORE]) == ALPACA[seqs.keep[0]]["output"] + EOS_TOKEN
    assert '"hub": "org/alpaca"' in sources.describe_source(cfg.data)  # the cache key names the hub dataset


def test_sft_path_wins_over_the_hub_name(tmp_path, tok, monkeypatch):
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(ALPACA[:2]))
    import datasets

    real = datasets.load_dataset
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    seqs = build_data(_cfg(tmp_path, kind="sft", path=str(path), name="org/alpaca", seq_len=128), tok, VOCAB,
                      log=lambda m: None).train.base
    assert len(seqs) == 2 and calls and all(a[0] == "json" for a in calls)


def test_sft_hub_dataset_unreachable_names_it_and_the_local_override(tmp_path, tok, monkeypatch):
    import datasets

    def offline(*a, **kw):
        raise ConnectionError("Couldn't reach 'org/alpaca' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as info:
        build_data(_cfg(tmp_path, kind="sft", name="org/alpaca", seq_len=128), tok, VOCAB, log=lambda m: None)
    assert str(info.value) == ("data.name='org/alpaca': cannot load the hub dataset (split 'train'): Couldn't reach "
                               "'org/alpaca' on the Hub (OfflineModeIsEnabled); without hub access, train on a "
                               "local copy with data.path=<a local copy of the records>")


def test_a_cache_of_an_older_chat_rendering_is_not_reused(tmp_path, tok, monkeypatch):
    """SFT caches carry the chat rendering's version: after a change in how records become tokens (tools and
    per-message weights reaching the template) the entry is built again, never read stale."""
    from trainer.data import sft

    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(ALPACA[:2]))
    cfg = _cfg(tmp_path, kind="sft", path=str(path), seq_len=128)
    logs, log = _logs()
    build_data(cfg, tok, VOCAB, log=log)
    build_data(cfg, tok, VOCAB, log=log)
    monkeypatch.setattr(sft, "RENDER_VERSION", sft.RENDER_VERSION + 1)
    build_data(cfg, tok, VOCAB, log=log)
    assert sum(m.startswith("tokenized") for m in logs) == 2 and len(_cache_entries(cfg.data.cache_dir)) == 2
