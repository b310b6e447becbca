"""Tokenizing a source into a sharded token store (trainer/data/shards.py): the shard plan, the tokens of one
shard, and the job that writes the shards with N worker processes, resumes shard by shard, takes one range of
shards per machine (--shard-range) and merges them into the manifest.

The plan depends only on the input: plain-text files are cut into byte ranges of whole documents (about
--shard-bytes each, text_files.document_starts), records (JSONL, parquet, hub, SFT, the embedded corpus) into
ranges of --shard-records. So every worker count and every machine writes the same shards, byte for byte.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

from models.registry import load_tokenizer
from tessera.errors import DataError
from trainer.data import sft, sources, shards as S
from trainer.data.embedded import VERSION as EMBEDDED_VERSION, embedded_documents
from trainer.data.store import tokenizer_fingerprint
from trainer.data.text_files import Piece, document_starts, is_compressed, read_documents, text_pieces

BATCH_CHARS = 1_000_000  # a batch's encodings take ~100 bytes per token inside the tokenizer
HEAD_BYTES = 1 << 20


def encode_pieces(tokenizer, pieces: Iterator[Piece]) -> Iterator[Tuple[np.ndarray, None, bool]]:
    """(token ids, None, ends a document) per piece, EOS after each document's last piece; tokenized in batches
    of at most 256 pieces or BATCH_CHARS characters."""
    eos, batch, chars = tokenizer.eos_token_id, [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece.text)
        if len(batch) == 256 or chars >= BATCH_CHARS:
            yield from _encode_batch(tokenizer, batch, eos)
            batch, chars = [], 0
    if batch:
        yield from _encode_batch(tokenizer, batch, eos)


def _encode_batch(tokenizer, pieces, eos):
    for piece, ids in zip(pieces, tokenizer([p.text for p in pieces], add_special_tokens=False)["input_ids"]):
        yield np.asarray(ids + [eos] if piece.ends else ids, dtype=np.int64), None, piece.ends


# ---- the plan ------------------------------------------------------------------------------------------------
def store_kind(d) -> str:
    if d.kind == "mixture" or d.follow:
        raise DataError(f"data={d.kind}{' with data.follow' if d.follow else ''} has no one store: tokenize each "
                        f"source into its own store (data=text, sft or hub), and name the stores in the mixture's "
                        f"sources (kind: tokens)")
    if d.kind == "preference":
        raise DataError("data=preference has no token store of its own: the training run tokenizes the pairs into its "
                        "cache (data.cache_dir) and scores the reference there; run the training command instead")
    return "sft" if d.kind == "sft" else "text"


def _file_identity(path: str) -> dict:
    """A file by name, size and the sha256 of its first MiB: the same on every machine that holds a copy."""
    with open(path, "rb") as fh:
        head = hashlib.sha256(fh.read(HEAD_BYTES)).hexdigest()
    return {"name": os.path.basename(path), "bytes": os.path.getsize(path), "head_sha256": head}


def shard_specs(src: Source, shard_bytes: int, shard_records: int) -> List[dict]:
    """Each shard's input range: plain-text files in byte ranges of whole documents of about shard_bytes, records
    in ranges of shard_records."""
    d, files = src.data, src.files
    if src.text_files:
        if d.max_records is not None:
            raise DataError("data.max_records: a token store holds whole text files; leave it unset (null) here "
                            "and cap the training run instead")
        specs = []
        for i, f in enumerate(files):
            # a compressed file is read from its start: one shard
            cuts = [0, None] if is_compressed(f) else document_starts(f, d.document_separator, shard_bytes)
            specs += [{"file": i, "start": a, "end": b} for a, b in zip(cuts, cuts[1:])]
        return specs
    n = d.embedded_documents if d.kind == "embedded" else len(src.record_source())
    return [{"records": [a, min(a + shard_records, n)]} for a in range(0, n, shard_records)]


def plan_of(src: Source, fingerprint: str, vocab_size: int, shard_bytes: int, shard_records: int) -> dict:
    """The store's plan: its identity (source, tokenizer `fingerprint`, settings) and each shard's input range."""
    d, files = src.data, src.files
    identity = {"kind": d.kind, "text_field": d.text_field, "max_records": d.max_records,
                "document_separator": d.document_separator, "max_document_chars": d.max_document_chars}
    specs = shard_specs(src, shard_bytes, shard_records)
    if files:
        identity["files"] = [_file_identity(f) for f in files]
    elif d.kind == "embedded":
        identity["embedded"] = [d.embedded_documents, EMBEDDED_VERSION]
    else:
        identity["hub"] = [d.name, d.config_name, d.split, d.revision]
    if d.kind == "sft":
        identity["chat_template"] = src.tokenizer.chat_template
        identity["render"] = sft.RENDER_VERSION
        identity.update({k: dict(getattr(d, k)) for k in ("columns", "roles") if getattr(d, k)})  # where set only
    if not specs:
        raise DataError("the data source has no documents or records to tokenize")
    return {"format": S.STORE_FORMAT, "version": S.STORE_VERSION, "kind": store_kind(d), "source": identity,
            "tokenizer": fingerprint, "vocab_size": vocab_size, "dtype": np.dtype(S.token_dtype(vocab_size)).name,
            "shards": [dict(spec, index=i) for i, spec in enumerate(specs)]}


def refuse_output_inside_input(out_dir: str, d, files: List[str]) -> None:
    """OUT_DIR inside a folder of data.path: the store's own JSON files would become part of the data next time."""
    out = os.path.abspath(out_dir)
    folders = [os.path.abspath(os.path.expanduser(p.strip())) for p in (d.path or "").split(",") if p.strip()]
    inside = [f for f in folders if os.path.isdir(f) and os.path.commonpath([out, f]) == f]
    inside += [f for f in files if os.path.commonpath([out, os.path.abspath(f)]) == out]
    if inside:
        raise DataError(f"OUT_DIR {out_dir} is inside the data it tokenizes (data.path={d.path}): its own files would "
                        f"be read as data; write the store to a folder outside data.path")


# ---- one shard -----------------------------------------------------------------------------------------------
@dataclass
class Source:
    """What a worker needs to tokenize shards: the data config, the tokenizer, the resolved files (a plain-text
    shard names its file by index) and, for records, the opened dataset (read once per worker)."""

    data: object
    tokenizer: object
    files: List[str]
    records: Optional[sources.Records] = None

    @property
    def text_files(self) -> bool:
        """Plain-text files (shards are byte ranges of them), not records."""
        return bool(self.files) and self.data.kind != "sft" and self.files[0].endswith(sources.TEXT_EXTS)

    def record_source(self) -> sources.Records:
        if self.records is None:
            self.records = sources.sft_records(self.data) if self.data.kind == "sft" else \
                sources.text_records(self.data)
        return self.records


def open_source(d, tokenizer, files: Optional[List[str]] = None) -> Source:
    """`files`: data.path resolved already (by the parent of a worker)."""
    if d.kind == "sft":
        sft.ensure_chat_template(tokenizer, d.chat_template)
    if files is None:
        files = [] if d.kind == "embedded" or sources.reads_hub(d) else sources.resolve_files(d.path)
    return Source(d, tokenizer, files)


def shard_items(spec: dict, src: Source) -> Iterator[Tuple[np.ndarray, Optional[np.ndarray], bool]]:
    """(token ids, mask or None, ends a document) of one shard of the plan."""
    d, cap = src.data, src.data.max_document_chars
    if "file" in spec:
        pieces = read_documents(src.files[spec["file"]], d.document_separator, cap, start=spec["start"],
                                end=spec["end"])
        yield from encode_pieces(src.tokenizer, pieces)
        return
    records = range(*spec["records"])
    if d.kind == "embedded":
        texts = embedded_documents(d.embedded_documents)[records.start:records.stop]
    elif d.kind == "sft":
        for _, conv in sources.sft_messages(src.record_source(), records):
            ids, mask = sft.encode_conversation(src.tokenizer, conv.messages, conv.tools)
            yield ids, mask, True
        return
    else:
        texts = sources.record_texts(src.record_source(), records)
    yield from encode_pieces(src.tokenizer, (p for text in texts for p in text_pieces(text, cap)))


def write_one(out_dir: str, plan: dict, spec: dict, src: Source) -> dict:
    """Tokenize and write shard `spec` into out_dir/shards/ (whole or not at all); its shard.json."""
    final = os.path.join(out_dir, S.SHARDS, S.shard_name(spec["index"]))
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        meta = S.write_shard(tmp, plan["kind"], plan["vocab_size"], shard_items(spec, src))
        S.commit_shard(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


# ---- the job -------------------------------------------------------------------------------------------------
@dataclass
class Job:
    out_dir: str
    workers: int = 1
    shard_range: Optional[Tuple[int, int]] = None  # [first, last) shards of the plan; None = all
    merge: bool = False  # only write the manifest from the shards present
    shard_bytes: int = 64 << 20
    shard_records: int = 20_000


def agree_on_plan(out_dir: str, plan: dict) -> None:
    """Write plan.json, or check that the one already there (an earlier or another machine's run) is this one."""
    os.makedirs(os.path.join(out_dir, S.SHARDS), exist_ok=True)
    path = os.path.join(out_dir, S.PLAN)
    if not os.path.exists(path):
        S.write_json(path, plan)
        return
    there = S.read_json(path)
    if there != plan:
        keys = sorted(k for k in set(plan) | set(there) if plan.get(k) != there.get(k))
        raise DataError(f"{out_dir} holds a token store of another source, tokenizer or settings (plan.json differs "
                        f"in: {', '.join(keys)}); write to a new folder, or delete this one")


def pending_shards(job: Job, plan: dict, log: Callable[[str], None]) -> List[dict]:
    """The shards of this run's range that are not yet whole (a damaged one is removed and written again)."""
    first, last = job.shard_range or (0, len(plan["shards"]))
    todo = []
    for spec in plan["shards"][first:last]:
        folder = os.path.join(job.out_dir, S.SHARDS, S.shard_name(spec["index"]))
        if os.path.isdir(folder):
            damage = S.shard_damage(folder)
            if damage is None:
                continue
            log(f"shard {spec['index']} is damaged ({damage}); writing it again")
            shutil.rmtree(folder)
        todo.append(spec)
    return todo


_WORKER: dict = {}


def _init_worker(data_cfg, model_cfg, files: List[str]) -> None:
    """Only keeps what the worker needs: an error while opening the source would make the pool start workers
    forever, so that happens in the first task, whose error reaches the parent."""
    _WORKER["args"] = (data_cfg, model_cfg, files)


def _work(args) -> Tuple[int, dict]:
    out_dir, plan, spec = args
    if "source" not in _WORKER:
        data_cfg, model_cfg, files = _WORKER["args"]
        _WORKER["source"] = open_source(data_cfg, load_tokenizer(model_cfg), files)
    return spec["index"], write_one(out_dir, plan, spec, _WORKER["source"])


def _context():
    """Workers forked from a server process that imported this module once (torch, transformers): each starts in
    a fraction of a second, and none inherits this process's threads (pyarrow's, the tokenizer's)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def write_shards(job: Job, plan: dict, todo: List[dict], cfg, src: Source, log) -> None:
    """Tokenize `todo` with job.workers processes (in this process for one), logging each shard as it lands."""
    t0, done_tokens, total = time.time(), 0, len(todo)
    if job.workers <= 1:
        results = ((spec["index"], write_one(job.out_dir, plan, spec, src)) for spec in todo)
        pool = None
    else:
        pool = _context().Pool(job.workers, initializer=_init_worker, initargs=(cfg.data, cfg.model, src.files))
        results = pool.imap_unordered(_work, [(job.out_dir, plan, spec) for spec in todo])
    try:
        for n, (index, meta) in enumerate(results, 1):
            done_tokens += meta["num_tokens"]
            rate = done_tokens / max(time.time() - t0, 1e-9)
            log(f"shard {index}: {meta['num_documents']} documents, {meta['num_tokens']} tokens ({n}/{total} of "
                f"this run, {rate:,.0f} tokens/s)")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()


def run(job: Job, cfg, tokenizer, vocab_size: int, log: Callable[[str], None] = print) -> Optional[dict]:
    """The whole job; the manifest once every shard of the plan is there, else None (other ranges to come)."""
    store_kind(cfg.data)  # a source that makes one store
    # the tokenizer as training will load it (data=tokens), before SFT installs its chat template (the source's)
    fingerprint = tokenizer_fingerprint(tokenizer)
    src = open_source(cfg.data, tokenizer)
    refuse_output_inside_input(job.out_dir, cfg.data, src.files)
    plan = plan_of(src, fingerprint, vocab_size, job.shard_bytes, job.shard_records)
    agree_on_plan(job.out_dir, plan)
    n = len(plan["shards"])
    if job.shard_range is not None and not (0 <= job.shard_range[0] < job.shard_range[1] <= n):
        raise DataError(f"--shard-range {job.shard_range[0]}:{job.shard_range[1]} is outside the plan's {n} shards "
                        f"(0:{n})")
    if not job.merge:
        todo = pending_shards(job, plan, log)
        log(f"{job.out_dir}: {n} shards in the plan, {len(todo)} to write"
            + (f" (range {job.shard_range[0]}:{job.shard_range[1]})" if job.shard_range else "")
            + f", {max(1, job.workers)} worker(s)")
        write_shards(job, plan, todo, cfg, src, log)
    present = [s for s in plan["shards"] if S.shard_damage(os.path.join(job.out_dir, S.SHARDS,
                                                                         S.shard_name(s["index"]))) is None]
    if len(present) < n and not job.merge:
        log(f"{len(present)} of {n} shards are written; the manifest follows when the other ranges are here "
            f"(then: --merge)")
        return None
    manifest = S.manifest_of(plan, job.out_dir, digests=job.merge)
    S.write_json(os.path.join(job.out_dir, S.MANIFEST), manifest)
    log(f"token store {job.out_dir}: {manifest['num_documents']} documents, {manifest['num_tokens']} tokens in "
        f"{n} shards")
    return manifest
