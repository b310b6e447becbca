"""The sharded token store that `python -m trainer.tokenize` writes and `data=tokens` trains from.

    OUT_DIR/plan.json         what each shard holds: its input range (a file's bytes or a range of records), the
                              source, tokenizer and settings; written first, the same on every machine
    OUT_DIR/shards/00042/     tokens.bin (token ids), offsets.npy (document boundaries), mask.bin (SFT: 1 = a
                              response token) and shard.json (counts, bytes and sha256 of each file)
    OUT_DIR/manifest.json     written once every shard is present: the plan plus each shard's counts and digests

A shard is written into a temporary folder and renamed into place, so a folder under shards/ is always whole; a
shard's bytes depend only on its input range and the tokenizer, so the store is the same for any number of
workers or machines. A cache entry of data=text / data=sft is a store of one shard in the same format.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
from typing import Iterable, Iterator, List, Optional, Tuple

import numpy as np

from tessera.errors import DataError, one_line

STORE_FORMAT = "tessera-token-store"
STORE_VERSION = 1
PLAN, MANIFEST, SHARDS = "plan.json", "manifest.json", "shards"
COPY_BYTES = 16 << 20


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def shard_name(index: int) -> str:
    return f"{index:05d}"


def write_json(path: str, value) -> None:
    """Whole or not at all: a temporary file renamed into place."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(value, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


def read_json(path: str):
    with open(path) as fh:
        return json.load(fh)


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _HashedFile:
    """A file written once, front to back, with its size and sha256 kept on the way (never read back)."""

    def __init__(self, path: str):
        self.path, self.bytes, self.sha256 = path, 0, hashlib.sha256()
        self._fh = open(path, "wb")

    def write(self, data: bytes) -> None:
        self._fh.write(data)
        self.sha256.update(data)
        self.bytes += len(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


def write_shard(folder: str, kind: str, vocab_size: int,
                items: Iterable[Tuple[np.ndarray, Optional[np.ndarray], bool]]) -> dict:
    """Write one shard into `folder` (created; renamed into place by the caller) from (token ids, mask or None,
    ends a document) per piece; returns its shard.json."""
    dtype = token_dtype(vocab_size)
    n_tokens, offsets = 0, [0]
    os.makedirs(folder)
    tokens, masks = _HashedFile(os.path.join(folder, "tokens.bin")), None
    if kind == "sft":
        masks = _HashedFile(os.path.join(folder, "mask.bin"))
    with tokens, (masks or contextlib.nullcontext()):
        for ids, mask, ends in items:
            ids = np.asarray(ids)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise DataError(f"token id {int(ids.max())} is outside the model's vocabulary ({vocab_size})")
            tokens.write(ids.astype(dtype).tobytes())
            if masks is not None:
                masks.write(np.asarray(mask, dtype=np.uint8).tobytes())
            n_tokens += ids.size
            if ends:
                offsets.append(n_tokens)
    np.save(os.path.join(folder, "offsets.npy"), np.asarray(offsets, dtype=np.int64))
    files = {"offsets.npy": {"bytes": os.path.getsize(os.path.join(folder, "offsets.npy")),
                             "sha256": file_digest(os.path.join(folder, "offsets.npy"))}}
    for written in (tokens, masks):
        if written is not None:
            files[os.path.basename(written.path)] = {"bytes": written.bytes, "sha256": written.sha256.hexdigest()}
    files = dict(sorted(files.items()))
    meta = {"kind": kind, "dtype": np.dtype(dtype).name, "num_tokens": n_tokens, "num_documents": len(offsets) - 1,
            "files": files}
    write_json(os.path.join(folder, "shard.json"), meta)
    return meta


def concatenate_shards(parts: List[str], folder: str) -> dict:
    """Write into `folder` (created) the one shard holding the shards `parts` one after another: the same files,
    byte for byte, as one write_shard over all their documents. Copied in blocks; returns its shard.json."""
    metas = [read_json(os.path.join(p, "shard.json")) for p in parts]
    kind, dtype = metas[0]["kind"], metas[0]["dtype"]
    os.makedirs(folder)
    files = {}
    for name in ("tokens.bin", "mask.bin") if kind == "sft" else ("tokens.bin",):
        with _HashedFile(os.path.join(folder, name)) as out:
            for part in parts:
                with open(os.path.join(part, name), "rb") as fh:
                    for block in iter(lambda: fh.read(COPY_BYTES), b""):
                        out.write(block)
        files[name] = {"bytes": out.bytes, "sha256": out.sha256.hexdigest()}
    offsets, base = [np.zeros(1, dtype=np.int64)], 0
    for part, meta in zip(parts, metas):
        offsets.append(np.load(os.path.join(part, "offsets.npy"))[1:] + base)
        base += meta["num_tokens"]
    np.save(os.path.join(folder, "offsets.npy"), np.concatenate(offsets))
    files["offsets.npy"] = {"bytes": os.path.getsize(os.path.join(folder, "offsets.npy")),
                            "sha256": file_digest(os.path.join(folder, "offsets.npy"))}
    meta = {"kind": kind, "dtype": dtype, "num_tokens": base, "num_documents": sum(m["num_documents"] for m in metas),
            "files": dict(sorted(files.items()))}
    write_json(os.path.join(folder, "shard.json"), meta)
    return meta


def shard_damage(folder: str, digests: bool = False) -> Optional[str]:
    """None for a whole shard, else what is wrong with it (checked by size, and by sha256 with `digests`)."""
    try:
        meta = read_json(os.path.join(folder, "shard.json"))
        files = meta["files"]
    except FileNotFoundError:
        return "shard.json is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"shard.json cannot be read: {one_line(e)}"
    for name, want in files.items():
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            return f"{name} is missing"
        if os.path.getsize(path) != want["bytes"]:
            return f"{name} has {os.path.getsize(path)} bytes, {want['bytes']} expected"
        if digests and file_digest(path) != want["sha256"]:
            return f"{name} does not match its sha256"
    return None


def commit_shard(tmp: str, final: str) -> None:
    """Rename a written shard into place (a shard already there from another worker or machine is kept)."""
    try:
        os.rename(tmp, final)
    except OSError:
        if shard_damage(final) is not None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def manifest_of(plan: dict, out_dir: str, digests: bool) -> dict:
    """The manifest from the plan and every shard's shard.json (all present and whole, else a DataError); with
    `digests` (--merge: shards copied from elsewhere) each file is checked against its sha256 too, else by size."""
    shards, missing = [], []
    for spec in plan["shards"]:
        folder = os.path.join(out_dir, SHARDS, shard_name(spec["index"]))
        damage = shard_damage(folder, digests) if os.path.isdir(folder) else "missing"
        if damage:
            missing.append(f"{spec['index']} ({damage})")
            continue
        shards.append(dict(spec, **read_json(os.path.join(folder, "shard.json"))))
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise DataError(f"{out_dir}: {len(missing)} of {len(plan['shards'])} shards are not there yet: {shown}; "
                        f"run the missing --shard-range (or copy its shards/ here) and --merge again")
    return dict(plan, shards=shards, num_tokens=sum(s["num_tokens"] for s in shards),
                num_documents=sum(s["num_documents"] for s in shards))


def iter_manifests(path_spec: str) -> Iterator[Tuple[str, dict]]:
    """(store folder, manifest) of each store named by data.path (a folder, a glob of folders, comma lists)."""
    for part in [p.strip() for p in path_spec.split(",") if p.strip()]:
        folders = sorted(glob.glob(os.path.expanduser(part))) if any(c in part for c in "*?[") else [part]
        if not folders:
            raise DataError(f"data.path={part!r}: the pattern matches no token store")
        for folder in folders:
            manifest = os.path.join(folder, MANIFEST)
            if not os.path.isfile(manifest):
                hint = " (its shards are not all written: run `python -m trainer.tokenize ... --merge`)" \
                    if os.path.isfile(os.path.join(folder, PLAN)) else ""
                raise DataError(f"data.path: {folder!r} is not a token store: no {MANIFEST}{hint}")
            try:
                yield folder, read_json(manifest)
            except (OSError, ValueError) as e:
                raise DataError(f"data.path: {manifest} cannot be read ({one_line(e)}); write the store's manifest "
                                f"again with python -m trainer.tokenize ... --merge") from None
