"""Tokenization done once per (data, tokenizer, format) and cached on disk.

Ranks never wait for each other in a collective here: each takes an exclusive file lock on the cache entry;
the first builds it into a temporary folder and renames it into place (atomic), the others wait on the lock
and then read the finished entry. So the first rank can tokenize for as long as it needs without any
collective timing out, and an interrupted build never leaves a half-written entry behind.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Tuple

import numpy as np

from tessera.errors import DataError, one_line
from trainer.data.shards import write_shard

FORMAT_VERSION = 2  # 2: document offsets for text too (data.packing=documents)


def default_cache_dir() -> str:
    return os.environ.get("TESSERA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tessera")


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token,
                         getattr(tokenizer, "chat_template", None)]).encode())
    return h.hexdigest()


@contextmanager
def file_lock(path: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class TokenStore:
    """A cache entry: `tokens.bin` (all token ids), `offsets.npy` (document / example boundaries) and for SFT
    `mask.bin` (1 = response token). Opened as read-only memory maps."""

    def __init__(self, path: str, meta: dict | None = None):
        """`meta`: the folder's description (a shard's shard.json), else read from its meta.json."""
        self.path = path
        if meta is None:
            with open(os.path.join(path, "meta.json")) as fh:
                meta = json.load(fh)
        self.meta = meta
        dtype = np.dtype(self.meta["dtype"])
        n = self.meta["num_tokens"]
        self.tokens = np.memmap(os.path.join(path, "tokens.bin"), dtype=dtype, mode="r", shape=(n,)) \
            if n else np.zeros(0, dtype=dtype)
        self.mask = None
        self.offsets = np.load(os.path.join(path, "offsets.npy"))
        if self.meta["kind"] == "sft":
            self.mask = np.memmap(os.path.join(path, "mask.bin"), dtype=np.uint8, mode="r", shape=(n,))


def entry_damage(path: str):
    """None for a complete cache entry, else what is wrong with it (a truncated or missing file, an unreadable
    manifest): checked by size against meta.json on every use, so a damaged entry is never trained on."""
    try:
        with open(os.path.join(path, "meta.json")) as fh:
            meta = json.load(fh)
        n, itemsize = int(meta["num_tokens"]), np.dtype(meta["dtype"]).itemsize
        expected = dict(meta.get("files") or {})
        expected.setdefault("tokens.bin", n * itemsize)
        expected.setdefault("offsets.npy", None)
        if meta.get("kind") == "sft":
            expected.setdefault("mask.bin", n)
    except KeyError as e:
        return f"meta.json has no {e} entry"
    except (OSError, ValueError, TypeError) as e:
        return f"meta.json cannot be read: {one_line(e)}"
    for name, size in expected.items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"{name} is missing"
        got = os.path.getsize(file)
        if size is not None and got != size:
            return f"{name} has {got} bytes, {size} expected"
    return None


def build_or_load(cache_dir: str, key: dict, kind: str, vocab_size: int,
                  produce: Callable[[], Iterable[Tuple[np.ndarray, np.ndarray | None]]],
                  log: Callable[[str], None] = print) -> TokenStore:
    """`produce` yields (token ids, mask or None) per document / example, or (token ids, mask or None, ends) per
    piece of one, `ends` False for every piece of a document but its last. `key` identifies the entry."""
    key = dict(key, format=FORMAT_VERSION, kind=kind)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    final = os.path.join(cache_dir, digest)
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise DataError(f"data.cache_dir={cache_dir!r} cannot be created: {e.strerror or one_line(e)}",
                        same_on_every_rank=False) from None  # a node's own folder
    with file_lock(final + ".lock"):
        if os.path.exists(os.path.join(final, "meta.json")):
            damage = entry_damage(final)
            if damage is None:
                return TokenStore(final)
            log(f"tokenization cache entry {final} is damaged ({damage}); rebuilding it")
            try:
                shutil.rmtree(final)
            except OSError as e:
                raise DataError(f"the tokenization cache entry {final} is damaged ({damage}) and cannot be removed "
                                f"({e.strerror or one_line(e)}); delete it, or set data.cache_dir (or "
                                f"TESSERA_CACHE) to a writable folder", same_on_every_rank=False) from None
        tmp = f"{final}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            t0 = time.time()
            meta = _write_entry(tmp, kind, vocab_size, produce())
            meta["key"], meta["kind"] = key, kind
            with open(os.path.join(tmp, "meta.json"), "w") as fh:
                json.dump(meta, fh)
            os.rename(tmp, final)
            log(f"tokenized {meta['num_documents']} documents into {meta['num_tokens']} tokens in "
                f"{time.time() - t0:.1f}s (cached at {final})")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return TokenStore(final)


def _write_entry(folder: str, kind: str, vocab_size: int,
                 items: Iterator[Tuple[np.ndarray, np.ndarray | None]]) -> dict:
    """The entry's files, written by the token store's shard writer (trainer/data/shards.py): a cache entry is one
    shard with a meta.json naming its key."""
    shard = write_shard(folder, kind, vocab_size, ((ids, mask, ends[0] if ends else True) for ids, mask, *ends in items))
    if shard["num_documents"] == 0 or shard["num_tokens"] == 0:
        raise DataError("the data source produced no tokens (no non-empty documents or records)")
    return {"dtype": shard["dtype"], "num_tokens": shard["num_tokens"], "num_documents": shard["num_documents"],
            "files": {name: f["bytes"] for name, f in shard["files"].items()}}
