"""Tokenization done once per (data, tokenizer, format) and cached on disk.

Ranks never wait for each other in a collective here: each takes an exclusive file lock on the cache entry;
the first builds it into a temporary folder and renames it into place (atomic), the others wait on the lock
and then read the finished entry. So the first rank can tokenize for as long as it needs without any
collective timing out, and an interrupted build never leaves a half-written entry behind. A source cut into
parts is tokenized by all the ranks that need the entry at once, a part each under its own lock, and the parts
joined into the same bytes one process would write.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from tessera.errors import DataError, one_line
from trainer.data.shards import commit_shard, concatenate_shards, shard_damage, shard_name, write_shard

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
                  log: Callable[[str], None] = print, parts: Optional[Callable[[], List[Callable]]] = None,
                  build_note: str = "") -> TokenStore:
    """`produce` yields (token ids, mask or None) per document / example, or (token ids, mask or None, ends) per
    piece of one, `ends` False for every piece of a document but its last. `key` identifies the entry. `parts`,
    when given, returns the same items cut into parts (each a `produce` of its own, in order) that every process
    building the entry at once tokenizes a share of (see _build_in_parts). `build_note` is logged when the entry
    is built."""
    key = dict(key, format=FORMAT_VERSION, kind=kind)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    final = os.path.join(cache_dir, digest)
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise DataError(f"data.cache_dir={cache_dir!r} cannot be created: {e.strerror or one_line(e)}",
                        same_on_every_rank=False) from None  # a node's own folder
    with file_lock(final + ".lock"):
        if _usable(final, log):
            return TokenStore(final)
    if build_note:
        log(build_note)
    producers = parts() if parts is not None else None
    if producers is not None and len(producers) == 1:
        produce = producers[0]  # the same items, from the source opened once already
    elif producers:
        t0 = time.time()
        if _build_in_parts(final, producers, kind, vocab_size):
            with file_lock(final + ".lock"):
                if not _usable(final, lambda message: None):
                    _commit(final, key, kind, lambda tmp: _merge_parts(tmp, final, len(producers)), log, t0,
                            f" in {len(producers)} parts, shared by the processes that needed it")
            shutil.rmtree(final + ".parts", ignore_errors=True)
        return TokenStore(final)
    with file_lock(final + ".lock"):
        if not _usable(final, log):
            _commit(final, key, kind, lambda tmp: _write_entry(tmp, kind, vocab_size, produce()), log, time.time())
    return TokenStore(final)


def _usable(final: str, log: Callable[[str], None]) -> bool:
    """Is the entry there and whole? A damaged one is removed (with a notice) so that it is built again."""
    if not os.path.exists(os.path.join(final, "meta.json")):
        return False
    damage = entry_damage(final)
    if damage is None:
        return True
    log(f"tokenization cache entry {final} is damaged ({damage}); rebuilding it")
    try:
        shutil.rmtree(final)
    except OSError as e:
        raise DataError(f"the tokenization cache entry {final} is damaged ({damage}) and cannot be removed "
                        f"({e.strerror or one_line(e)}); delete it, or set data.cache_dir (or "
                        f"TESSERA_CACHE) to a writable folder", same_on_every_rank=False) from None
    return False


def _commit(final: str, key: dict, kind: str, write: Callable[[str], dict], log, t0: float, how: str = "") -> None:
    """Write the entry into a temporary folder and rename it into place (whole or not at all)."""
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        meta = write(tmp)
        meta["key"], meta["kind"] = key, kind
        with open(os.path.join(tmp, "meta.json"), "w") as fh:
            json.dump(meta, fh)
        os.rename(tmp, final)
        log(f"tokenized {meta['num_documents']} documents into {meta['num_tokens']} tokens in "
            f"{time.time() - t0:.1f}s{how} (cached at {final})")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _build_in_parts(final: str, producers: List[Callable], kind: str, vocab_size: int) -> bool:
    """Every process that builds the entry at once (the ranks of a node, and of any node sharing the folder) takes
    the parts nobody holds, each under its own file lock, starting at its local rank; then waits for (or, when its
    holder died, builds) the rest. False when the entry appeared meanwhile."""
    folder = final + ".parts"
    os.makedirs(folder, exist_ok=True)
    n = len(producers)
    first = int(os.environ.get("LOCAL_RANK", "0")) % n
    for blocking in (False, True):
        for i in [(first + j) % n for j in range(n)]:
            if _build_part(folder, i, producers[i], kind, vocab_size, blocking, final) == "entry":
                return False
    return True


def _build_part(folder: str, i: int, produce: Callable, kind: str, vocab_size: int, blocking: bool,
                final: str) -> str:
    part = os.path.join(folder, shard_name(i))
    with open(part + ".lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            return "busy"  # another process builds it
        try:
            if shard_damage(part) is None:
                return "done"
            if os.path.exists(os.path.join(final, "meta.json")):
                return "entry"  # merged meanwhile (its parts removed)
            tmp = f"{part}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                write_shard(tmp, kind, vocab_size, _pieces(produce()))
                commit_shard(tmp, part)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return "built"
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _merge_parts(tmp: str, final: str, n: int) -> dict:
    parts = [os.path.join(final + ".parts", shard_name(i)) for i in range(n)]
    for part in parts:
        damage = shard_damage(part)
        if damage is not None:
            raise DataError(f"the tokenization cache part {part} is damaged ({damage}); delete {final}.parts and "
                            f"start again", same_on_every_rank=False)
    return _entry_meta(concatenate_shards(parts, tmp))


def _pieces(items) -> Iterator:
    return ((ids, mask, ends[0] if ends else True) for ids, mask, *ends in items)


def _write_entry(folder: str, kind: str, vocab_size: int,
                 items: Iterator[Tuple[np.ndarray, np.ndarray | None]]) -> dict:
    """The entry's files, written by the token store's shard writer (trainer/data/shards.py): a cache entry is one
    shard with a meta.json naming its key."""
    return _entry_meta(write_shard(folder, kind, vocab_size, _pieces(items)))


def _entry_meta(shard: dict) -> dict:
    if shard["num_documents"] == 0 or shard["num_tokens"] == 0:
        raise DataError("the data source produced no tokens (no non-empty documents or records)")
    return {"dtype": shard["dtype"], "num_tokens": shard["num_tokens"], "num_documents": shard["num_documents"],
            "files": {name: f["bytes"] for name, f in shard["files"].items()}}
