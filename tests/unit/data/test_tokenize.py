"""`python -m trainer.tokenize` (trainer/data/tokenizing.py, trainer/data/shards.py): a sharded token store whose
bytes do not depend on the number of workers or machines, resumed shard by shard, split by --shard-range and merged,
from plain text, JSONL, parquet, SFT records and the embedded corpus; the same tokens as training's own cache."""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models.tokenizer import embedded_tokenizer
from trainer.config.schema import DataConfig, TesseraConfig
from trainer.data import shards as S
from trainer.data.datasets import build_data
from trainer.data.tokenizing import Job, run
from tessera.errors import DataError

REPO = Path(__file__).resolve().parents[3]
VOCAB = 264


def _corpus(folder: Path, n_files: int = 2, docs: int = 120) -> Path:
    rng = random.Random(0)
    words = ["lorem", "ipsum", "dolor", "sit", "amet", "é", "日本"]
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        text = "\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(1, 300))) for _ in range(docs))
        (folder / f"part{f}.txt").write_text(text, encoding="utf-8")
    return folder


def _cfg(**data) -> TesseraConfig:
    cfg = TesseraConfig()
    cfg.data = DataConfig(**data)
    return cfg


def _tokenize(out, cfg, **job):
    job.setdefault("shard_bytes", 4096)
    job.setdefault("shard_records", 7)
    return run(Job(str(out), **job), cfg, embedded_tokenizer(), VOCAB, log=lambda m: None)


def _tree_digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _store_tokens(out: Path) -> list:
    manifest = json.loads((out / S.MANIFEST).read_text())
    tokens = []
    for shard in manifest["shards"]:
        tokens += np.fromfile(out / S.SHARDS / S.shard_name(shard["index"]) / "tokens.bin",
                              dtype=manifest["dtype"]).tolist()
    return tokens


def test_text_files_become_shards_of_whole_documents_with_the_training_tokens(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    cfg = _cfg(kind="text", path=str(corpus), cache_dir=str(tmp_path / "cache"), val_fraction=0.0)
    manifest = _tokenize(tmp_path / "store", cfg)
    assert len(manifest["shards"]) > 4
    assert manifest["num_documents"] == 240 == sum(s["num_documents"] for s in manifest["shards"])
    # the same token stream, EOS per document, as training's own tokenization of these files
    data = build_data(cfg, embedded_tokenizer(), VOCAB, log=lambda m: None)
    assert _store_tokens(tmp_path / "store") == np.asarray(data.train.base.tokens).tolist()
    for shard in manifest["shards"]:
        folder = tmp_path / "store" / S.SHARDS / S.shard_name(shard["index"])
        offsets = np.load(folder / "offsets.npy")
        assert offsets[0] == 0 and offsets[-1] == shard["num_tokens"] and len(offsets) == shard["num_documents"] + 1
        tokens = np.fromfile(folder / "tokens.bin", dtype=np.uint16)
        assert tokens[-1] == embedded_tokenizer().eos_token_id  # a shard ends with a whole document


def test_compressed_text_files_are_one_shard_each_with_the_same_tokens(tmp_path):
    import gzip

    corpus = _corpus(tmp_path / "corpus")
    packed = tmp_path / "packed"
    packed.mkdir()
    for f in sorted(corpus.glob("*.txt")):
        (packed / (f.name + ".gz")).write_bytes(gzip.compress(f.read_bytes()))
    plain = _tokenize(tmp_path / "plain-store", _cfg(kind="text", path=str(corpus)), workers=2)
    manifest = _tokenize(tmp_path / "packed-store", _cfg(kind="text", path=str(packed)), workers=2)
    assert len(plain["shards"]) > 4 and len(manifest["shards"]) == 2  # a compressed file has no byte ranges
    assert manifest["num_documents"] == plain["num_documents"] == 240
    assert _store_tokens(tmp_path / "packed-store") == _store_tokens(tmp_path / "plain-store")


def test_the_store_is_byte_identical_for_any_number_of_workers(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    cfg = _cfg(kind="text", path=str(corpus))
    _tokenize(tmp_path / "one", cfg, workers=1)
    _tokenize(tmp_path / "three", cfg, workers=3)
    assert _tree_digest(tmp_path / "one") == _tree_digest(tmp_path / "three")


def test_ranges_on_two_machines_merge_into_the_same_store(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    cfg = _cfg(kind="text", path=str(corpus))
    whole = _tokenize(tmp_path / "whole", cfg)
    n = len(whole["shards"])
    assert _tokenize(tmp_path / "m1", cfg, shard_range=(0, n // 2)) is None  # not all there: no manifest yet
    assert not (tmp_path / "m1" / S.MANIFEST).exists()
    _tokenize(tmp_path / "m2", cfg, shard_range=(n // 2, n))
    with pytest.raises(DataError, match=f"{n - n // 2} of {n} shards are not there yet"):
        _tokenize(tmp_path / "m1", cfg, merge=True)
    for shard in (tmp_path / "m2" / S.SHARDS).iterdir():  # the second machine's shards copied over
        shutil.copytree(shard, tmp_path / "m1" / S.SHARDS / shard.name)
    _tokenize(tmp_path / "m1", cfg, merge=True)
    assert _tree_digest(tmp_path / "m1") == _tree_digest(tmp_path / "whole")


def test_an_interrupted_run_resumes_shard_by_shard(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    cfg = _cfg(kind="text", path=str(corpus))
    _tokenize(tmp_path / "whole", cfg)
    out = tmp_path / "out"
    _tokenize(out, cfg)
    (out / S.MANIFEST).unlink()
    shutil.rmtree(out / S.SHARDS / "00002")  # never written
    (out / S.SHARDS / "00003" / "tokens.bin").write_bytes(b"\0\0")  # cut short by a crash
    before = (out / S.SHARDS / "00001" / "tokens.bin").stat().st_mtime_ns
    notes = []
    run(Job(str(out), shard_bytes=4096), cfg, embedded_tokenizer(), VOCAB, log=notes.append)
    assert any("shard 3 is damaged" in m for m in notes) and any("2 to write" in m for m in notes), notes
    assert (out / S.SHARDS / "00001" / "tokens.bin").stat().st_mtime_ns == before  # whole shards are kept
    assert _tree_digest(out) == _tree_digest(tmp_path / "whole")


def test_another_source_in_the_same_folder_is_refused(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    _tokenize(tmp_path / "out", _cfg(kind="text", path=str(corpus)))
    with pytest.raises(DataError, match="another source, tokenizer or settings .*source"):
        _tokenize(tmp_path / "out", _cfg(kind="text", path=str(corpus), max_document_chars=50))


def test_jsonl_parquet_sft_and_embedded_sources_shard_by_records(tmp_path):
    records = [{"text": f"record {i} " * (i % 5 + 1)} for i in range(30)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), tmp_path / "r.parquet")
    for name, cfg in [("jsonl", _cfg(kind="text", path=str(tmp_path / "r.jsonl"))),
                      ("parquet", _cfg(kind="text", path=str(tmp_path / "r.parquet")))]:
        manifest = _tokenize(tmp_path / name, cfg)
        assert [s["num_documents"] for s in manifest["shards"]] == [7, 7, 7, 7, 2], name
        assert _store_tokens(tmp_path / name)[:8] == list(b"record 0") and manifest["kind"] == "text"
    sft = [{"instruction": f"Say {i}", "output": f"{i}!"} for i in range(10)]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    manifest = _tokenize(tmp_path / "sft", _cfg(kind="sft", path=str(tmp_path / "s.jsonl")))
    assert manifest["kind"] == "sft" and manifest["num_documents"] == 10
    assert (tmp_path / "sft" / S.SHARDS / "00000" / "mask.bin").stat().st_size == manifest["shards"][0]["num_tokens"]
    manifest = _tokenize(tmp_path / "emb", _cfg(kind="embedded", embedded_documents=20), shard_records=8)
    assert [s["num_documents"] for s in manifest["shards"]] == [8, 8, 4]


def test_the_command_writes_the_store_and_refuses_bad_input(tmp_path):
    corpus = _corpus(tmp_path / "corpus", n_files=1, docs=20)
    cmd = [sys.executable, "-m", "trainer.tokenize", str(tmp_path / "out"), "--workers", "2", "data=text",
           f"data.path={corpus}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train on it with data=tokens data.path=" in proc.stdout
    assert json.loads((tmp_path / "out" / S.MANIFEST).read_text())["num_documents"] == 20
    for extra, message in [(["data.path=/no/such.txt"], "no such file"),
                           (["data.bogus=1"], "does not compose"),
                           (["data=mixture", f"data.sources=[{{name: a, kind: text, path: {corpus}, weight: 1}}]"],
                            "tokenize each source into its own store"),
                           (["--shard-range", "5:9", "data=text", f"data.path={corpus}"], "outside the plan's")]:
        args = cmd[:4] + extra if extra[0].startswith(("--", "data=")) else cmd[:4] + ["data=text"] + extra
        proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, \
            (extra, proc.returncode, proc.stderr[-2000:])


def test_a_worker_that_meets_bad_input_ends_the_command_with_one_message(tmp_path):
    """A file that is not UTF-8, tokenized by 2 workers: exit 2 naming the file (the pool does not restart its
    workers forever); OUT_DIR inside data.path is refused before anything is written."""
    corpus = _corpus(tmp_path / "corpus", n_files=1, docs=20)
    (corpus / "z-broken.txt").write_bytes(b"fine\n\n\xff\xfe broken\n")
    cmd = [sys.executable, "-m", "trainer.tokenize", str(tmp_path / "out"), "--workers", "2", "data=text",
           f"data.path={corpus}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "z-broken.txt: it is not UTF-8 text" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (corpus / "z-broken.txt").unlink()
    with pytest.raises(DataError, match="inside the data it tokenizes"):
        _tokenize(corpus / "store", _cfg(kind="text", path=str(corpus)))
    assert not (corpus / "store").exists()
