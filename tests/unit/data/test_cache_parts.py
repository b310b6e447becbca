"""The tokenization cache built in parts by the processes that need it at once (the ranks of a node): every part
tokenized once, by several processes, and the entry byte for byte the one a single process writes, for plain
text, JSONL records and SFT examples."""
from __future__ import annotations

import json
import re
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from models.tokenizer import embedded_tokenizer
from trainer.config.schema import DataConfig, TesseraConfig
from trainer.data import datasets

import cache_worker  # tests/unit/data/cache_worker.py: light, for spawned processes

VOCAB = 264


def test_processes_share_the_parts_of_an_entry_and_read_the_same_one(tmp_path):
    cache_dir, marks = tmp_path / "cache", tmp_path / "marks"
    marks.mkdir()
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=cache_worker.build_in_parts_concurrently,
                         args=(str(cache_dir), str(marks), barrier, results)) for _ in range(3)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=90) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
    assert not [logs for _, path, _, logs in got if path is None], got
    assert len({path for _, path, _, _ in got}) == 1
    assert all(tokens == cache_worker.expected_part_tokens() for _, _, tokens, _ in got)
    built = sorted(os.listdir(marks))
    assert sorted(int(m.split("-")[0][4:]) for m in built) == list(range(cache_worker.PARTS))  # each part once
    assert len({m.split("-")[1] for m in built}) >= 2, built  # by more than one process
    merged = [logs for *_, logs in got if any(m.startswith("tokenized") for m in logs)]
    assert len(merged) == 1 and "in 6 parts" in merged[0][0]
    entry = Path(got[0][1]).name
    assert sorted(os.listdir(cache_dir)) == [entry, entry + ".lock"]  # parts and temporary folders removed


def _write_corpora(root: Path) -> dict:
    words = "the quick brown fox jumps over a lazy dog while rivers run to the sea".split()
    docs = [" ".join(words[(i + j) % len(words)] for j in range(5 + i % 40)) for i in range(300)]
    (root / "a.txt").write_text("\n\n".join(docs[:200]))
    (root / "b.txt").write_text("\n\n".join(docs[200:]) + "\n")
    (root / "r.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "s.jsonl").write_text("".join(json.dumps({"instruction": d[:30], "output": d}) + "\n" for d in docs))
    return {"text-files": dict(kind="text", path=f"{root}/a.txt,{root}/b.txt"),
            "records": dict(kind="text", path=str(root / "r.jsonl")),
            "sft": dict(kind="sft", path=str(root / "s.jsonl"))}


def _entry_files(cache_dir: Path) -> dict:
    entry = next(p for p in cache_dir.iterdir() if p.is_dir())
    meta = json.loads((entry / "meta.json").read_text())
    return {"meta": {k: meta[k] for k in ("num_tokens", "num_documents", "files", "dtype")},
            **{f.name: f.read_bytes() for f in entry.iterdir() if f.name != "meta.json"}}


@pytest.mark.parametrize("source", ["text-files", "records", "sft"])
def test_an_entry_built_in_parts_is_the_one_process_entry_byte_for_byte(tmp_path, monkeypatch, source):
    root = tmp_path / "data"
    root.mkdir()
    spec = _write_corpora(root)[source]
    tok = embedded_tokenizer()
    built = {}
    for how in ("one", "parts"):
        cfg = TesseraConfig()
        cfg.data = DataConfig(**spec, cache_dir=str(tmp_path / how), val_fraction=0.0, seq_len=256)
        logs = []
        if how == "one":
            monkeypatch.setattr(datasets, "_cache_parts", lambda d, t: None)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(datasets, "CACHE_PART_BYTES", 2000)
            monkeypatch.setattr(datasets, "CACHE_PART_RECORDS", 37)
        datasets.build_data(cfg, tok, VOCAB, log=logs.append)
        built[how] = (_entry_files(tmp_path / how), logs)
    assert not re.search(r"in \d+ parts", built["one"][1][0]) and re.search(r"in \d+ parts", built["parts"][1][0])
    assert built["parts"][0] == built["one"][0]
    assert not [p for p in (tmp_path / "parts").iterdir() if p.name.endswith(".parts")]


def test_a_run_over_several_nodes_says_once_where_its_cache_is_built(tmp_path, monkeypatch):
    root = tmp_path / "data"
    root.mkdir()
    spec = _write_corpora(root)["records"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    logs = []
    for _ in range(2):
        cfg = TesseraConfig()
        cfg.data = DataConfig(**spec, cache_dir=str(tmp_path / "cache"), val_fraction=0.0, seq_len=64)
        datasets.build_data(cfg, embedded_tokenizer(), VOCAB, log=logs.append)
    notes = [m for m in logs if "spans several nodes" in m]
    assert len(notes) == 1 and str(tmp_path / "cache") in notes[0]  # said when built, not when found
