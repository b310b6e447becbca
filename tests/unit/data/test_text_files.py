"""Plain-text files of any size (trainer/data/text_files.py): documents cut at blank lines or a separator, long
documents in pieces of at most data.max_document_chars kept as one document, the same cuts whatever the read block
size, and memory that does not grow with the file."""
from __future__ import annotations

import random
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models.tokenizer import embedded_tokenizer
from trainer.config.schema import DataConfig, TesseraConfig
from trainer.data.datasets import build_data
from trainer.data.text_files import document_start_at, document_starts, read_documents
from tessera.errors import DataError

VOCAB, EOS = 264, 256
REPO = Path(__file__).resolve().parents[3]


def documents(path, separator=None, max_chars=1_000_000, read_bytes=1 << 20) -> list:
    """Whole documents: the pieces joined."""
    out, current = [], ""
    for piece in read_documents(str(path), separator, max_chars, read_bytes):
        current += piece.text
        if piece.ends:
            out.append(current)
            current = ""
    assert current == ""
    return out


def test_blank_lines_end_documents_and_runs_of_them_count_once(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("First: one\nline two\n\nSecond\n \n\t\n\nThird ü\n\n\n", encoding="utf-8")
    assert documents(f) == ["First: one\nline two", "Second", "Third ü"]  # the last blank lines end "Third ü"


def test_a_configured_separator_is_matched_exactly(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one\n\nstill one<|doc|>two<|doc|><|doc|>three", encoding="utf-8")
    assert documents(f, "<|doc|>") == ["one\n\nstill one", "two", "three"]


def test_long_documents_come_in_capped_pieces_cut_at_whitespace_and_stay_one_document(tmp_path):
    f = tmp_path / "a.txt"
    long = " ".join(f"w{i}" for i in range(3000))
    f.write_text(f"short\n\n{long}\n\n{'x' * 250}", encoding="utf-8")
    pieces = list(read_documents(str(f), None, 100))
    assert all(len(p.text) <= 100 for p in pieces)
    assert [p.text for p in pieces if p.ends] [0] == "short"
    body = [p for p in pieces[1:] if not p.text.startswith("x")]
    assert all(p.text.endswith(" ") for p in body[:-1])  # cut after whitespace: no word is split
    assert documents(f, max_chars=100) == ["short", long, "x" * 250]


@pytest.mark.parametrize("read_bytes", [5, 64, 4096])
def test_the_cuts_do_not_depend_on_the_read_block_size(tmp_path, read_bytes):
    rng = random.Random(0)
    words = ["alpha", "beta", "é", "日本", "γ"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.choice([1, 5, 80, 600]))) for _ in range(120)]
    f = tmp_path / "a.txt"
    f.write_text("\n\n".join(docs) + "\n\n\n \n", encoding="utf-8")
    for cap in (40, 1_000_000):
        assert list(read_documents(str(f), None, cap, read_bytes)) == list(read_documents(str(f), None, cap))
    assert documents(f, read_bytes=read_bytes) == docs


def _cfg(tmp_path, **data) -> TesseraConfig:
    cfg = TesseraConfig()
    cfg.data = DataConfig(cache_dir=str(tmp_path / "cache"), val_fraction=0.0, **data)
    return cfg


def test_text_training_data_has_one_eos_per_document_not_per_piece(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("ab cd ef\n\ngh", encoding="utf-8")
    data = build_data(_cfg(tmp_path, kind="text", path=str(f), seq_len=2, max_document_chars=3), embedded_tokenizer(),
                      VOCAB, log=lambda m: None)
    stream = np.asarray(data.train.base.tokens, dtype=np.int64).tolist()
    assert stream == list(b"ab cd ef") + [EOS] + list(b"gh") + [EOS]
    assert "2 documents" in data.description


def test_max_records_counts_documents_of_text_files(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one\n\ntwo\n\nthree\n\nfour", encoding="utf-8")
    data = build_data(_cfg(tmp_path, kind="text", path=str(f), seq_len=2, max_records=2), embedded_tokenizer(), VOCAB,
                      log=lambda m: None)
    assert np.asarray(data.train.base.tokens).tolist() == list(b"one") + [EOS] + list(b"two") + [EOS]


def test_a_file_that_is_not_utf8_is_one_data_error(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"fine text\n\n\xff\xfe broken")
    with pytest.raises(DataError, match="a.txt: it is not UTF-8 text"):
        build_data(_cfg(tmp_path, kind="text", path=str(f), seq_len=2), embedded_tokenizer(), VOCAB, log=print)


MEASURE = """
import resource, sys
from models.tokenizer import embedded_tokenizer
from trainer.config.schema import DataConfig, TesseraConfig
from trainer.data.datasets import build_data
cfg = TesseraConfig()
cfg.data = DataConfig(kind="text", path=sys.argv[1], cache_dir=sys.argv[2], seq_len=64, val_fraction=0.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
data = build_data(cfg, embedded_tokenizer(), 264, log=lambda m: None)
print("GROWTH_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, data.num_tokens)
"""


def _growth_kb(path, cache) -> tuple:
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(cache)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, kb, tokens = next(line for line in proc.stdout.splitlines() if line.startswith("GROWTH_KB")).split()
    return int(kb), int(tokens)


def test_peak_memory_does_not_grow_with_the_file(tmp_path):
    """Tokenizing 8 MB and 64 MB of text (one single-line document of 64 MB among them): the growth of the peak
    resident memory stays within a bound that is far below the file sizes and does not grow 8x with them."""
    rng = random.Random(1)
    paragraph = " ".join(rng.choice(["lorem", "ipsum", "dolor", "sit", "amet"]) for _ in range(2000))
    small, large = tmp_path / "small.txt", tmp_path / "large.txt"
    small.write_text("\n\n".join([paragraph] * 700), encoding="utf-8")  # ~8.4 MB, 700 documents
    with open(large, "w", encoding="utf-8") as fh:
        fh.write("\n\n".join([paragraph] * 2800) + "\n\n")  # ~34 MB of documents, then one 34 MB line
        fh.write(" ".join([paragraph] * 2800))
    kb_small, tokens_small = _growth_kb(small, tmp_path / "cache")
    kb_large, tokens_large = _growth_kb(large, tmp_path / "cache")
    print(f"peak RSS growth: {kb_small} KiB for {tokens_small} tokens, {kb_large} KiB for {tokens_large} tokens")
    assert tokens_large > 7 * tokens_small
    assert kb_large < 160 * 1024 and kb_large < 2 * kb_small + 48 * 1024, (kb_small, kb_large)


def test_an_empty_separator_is_a_config_problem():
    from trainer.config.schema import validate

    cfg = TesseraConfig()
    cfg.data = DataConfig(kind="text", path="x.txt", document_separator="")
    assert any(p.startswith("data.document_separator='' is empty") for p in validate(cfg, 1))


@pytest.mark.parametrize("separator", [None, "<|doc|>"])
def test_document_start_at_finds_the_next_start_without_reading_from_the_front(tmp_path, separator):
    """document_start_at(x) = the first of all document starts (document_starts cutting at every one) at or after
    x, for every x; whitespace runs of every shape between documents, a separator at the very end."""
    rng = random.Random(3)
    joins = ["\n\n", "\n \n", "\n\t\n\n  ", "\n\n\n\n", " \n\r\n\n "] if separator is None else [separator]
    text = "".join(f"doc {i} " + "w" * rng.randint(0, 40) + rng.choice(joins) for i in range(60))
    path = tmp_path / "c.txt"
    path.write_text(text)
    size = path.stat().st_size
    starts = document_starts(str(path), separator, every=1, read_bytes=64)
    for x in range(0, size + 1):
        want = next((s for s in starts if s >= x), size)
        assert document_start_at(str(path), separator, x, read_bytes=64) == want, x
