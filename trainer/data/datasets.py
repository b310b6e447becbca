"""Fixed-length training sequences over a token store, the train/validation split, and their assembly.

Each sequence is (input_ids, labels) of length seq_len; labels[t] is the target of position t (the next
token) or -100 where no loss is taken. data.packing=eos (the default): packed text, the token stream
(documents joined by EOS) cut into windows of seq_len + 1 tokens that overlap by one; SFT, one example per
sequence, truncated and padded, labels only on response tokens. data.packing=documents: several documents (or
examples) per sequence, each with position ids from 0 and attention kept inside it (DocumentPackedSequences).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from trainer.data import sft, sources, token_stores, tokenizing
from trainer.data.embedded import VERSION as EMBEDDED_VERSION, embedded_documents
from trainer.data.follow import FollowData
from trainer.data.mixture import build_mixture
from trainer.data.preference import PreferencePairs, pair_items, preference_records
from trainer.data.sampler import GlobalBatchSampler
from trainer.data.streaming import StreamData
from trainer.data.store import TokenStore, build_or_load, default_cache_dir, tokenizer_fingerprint
from trainer.data.tokenizing import encode_pieces
from trainer.parallel.dims import env_spans_nodes
from tessera.errors import DataError

IGNORE = -100


class PackedSequences:
    def __init__(self, store: TokenStore, seq_len: int):
        self.tokens, self.seq_len = store.tokens, seq_len
        self.num = (len(self.tokens) - 1) // seq_len

    def __len__(self):
        return self.num

    def get(self, indices) -> dict:
        L = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * L: i * L + L + 1], dtype=np.int64) for i in indices])
        return {"input_ids": torch.from_numpy(rows[:, :-1].copy()), "labels": torch.from_numpy(rows[:, 1:].copy())}

    def count_targets(self, indices) -> int:
        return len(indices) * self.seq_len


class SFTSequences:
    def __init__(self, store: TokenStore, seq_len: int, pad_id: int):
        self.tokens, self.mask, self.offsets = store.tokens, store.mask, store.offsets
        self.seq_len, self.pad_id = seq_len, pad_id
        starts, ends = self.offsets[:-1], self.offsets[1:]
        stop = np.minimum(ends, starts + seq_len + 1)
        csum = np.concatenate([[0], np.cumsum(np.asarray(self.mask, dtype=np.int64))])
        # Targets are positions 1.. of an example (position 0 has no previous token to predict it from).
        targets = csum[stop] - csum[np.minimum(starts + 1, stop)]
        self.keep = np.nonzero(targets > 0)[0]  # examples whose response survives truncation
        self.targets = targets[self.keep]
        self.dropped = int(len(starts) - len(self.keep))
        if not len(self.keep):
            raise DataError(f"no SFT example keeps a response token within data.seq_len={seq_len}; "
                            f"raise data.seq_len")

    def __len__(self):
        return len(self.keep)

    def get(self, indices) -> dict:
        L = self.seq_len
        ids = np.full((len(indices), L + 1), self.pad_id, dtype=np.int64)
        tgt = np.zeros((len(indices), L + 1), dtype=bool)
        for row, i in enumerate(indices):
            ex = self.keep[i]
            lo, hi = self.offsets[ex], min(self.offsets[ex + 1], self.offsets[ex] + L + 1)
            ids[row, : hi - lo] = self.tokens[lo:hi]
            tgt[row, : hi - lo] = self.mask[lo:hi].astype(bool)
        labels = np.where(tgt[:, 1:], ids[:, 1:], IGNORE)
        return {"input_ids": torch.from_numpy(ids[:, :-1].copy()), "labels": torch.from_numpy(labels)}

    def count_targets(self, indices) -> int:
        return int(self.targets[np.asarray(indices, dtype=np.int64)].sum())


class DocumentPackedSequences:
    """data.packing=documents: whole documents placed one after another in rows of seq_len positions, in corpus
    order; a row ends where the next piece does not fit (the rest is padding, no loss). A piece is a document's
    tokens but its last as inputs and its tokens from the second on as labels, with position ids from 0: Hugging
    Face models read restarting position ids as packed sequences and keep attention inside each piece (a
    block-diagonal mask with SDPA / eager / flex attention, varlen flash-attention), so no token sees or predicts
    another document's, and a row trains what its pieces would train one by one. A text document longer than
    seq_len + 1 tokens is cut into pieces of seq_len + 1 tokens overlapping by one; an SFT example is truncated to
    seq_len + 1 tokens (as with packing=eos) and dropped when no response token survives."""

    def __init__(self, store: TokenStore, seq_len: int, pad_id: int):
        self.tokens, self.mask, self.seq_len, self.pad_id = store.tokens, store.mask, seq_len, pad_id
        offsets = np.asarray(store.offsets, dtype=np.int64)
        starts, lengths = [], []  # the pieces: first token and number of positions (tokens - 1)
        for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            if self.mask is not None:  # SFT: one piece, truncated
                starts.append(lo)
                lengths.append(min(hi - lo, seq_len + 1) - 1)
            else:
                for a in range(lo, hi - 1, seq_len):
                    starts.append(a)
                    lengths.append(min(hi - a, seq_len + 1) - 1)
        starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        if self.mask is not None:
            csum = np.concatenate([[0], np.cumsum(np.asarray(self.mask, dtype=np.int64))])
            targets = csum[starts + lengths + 1] - csum[starts + 1]
            self.dropped = int(np.sum(targets == 0))
        else:
            targets = lengths.copy()
            self.dropped = 0
        keep = (targets > 0) & (lengths > 0)
        self.starts, self.lengths, targets = starts[keep], lengths[keep], targets[keep]
        if not len(self.starts):
            raise DataError(f"no document keeps a target token within data.seq_len={seq_len}; raise data.seq_len")
        # Rows: consecutive pieces while they fit.
        row_of = np.empty(len(self.starts), dtype=np.int64)
        row, used = 0, 0
        for i, n in enumerate(self.lengths.tolist()):
            if used + n > seq_len:
                row, used = row + 1, 0
            row_of[i] = row
            used += n
        self.row_ptr = np.searchsorted(row_of, np.arange(row + 2))  # pieces of row r: row_ptr[r]:row_ptr[r + 1]
        self.targets = np.add.reduceat(targets, self.row_ptr[:-1])
        self.num_pieces = len(self.starts)

    def __len__(self):
        return len(self.row_ptr) - 1

    def get(self, indices) -> dict:
        L = self.seq_len
        ids = np.full((len(indices), L), self.pad_id, dtype=np.int64)
        labels = np.full((len(indices), L), IGNORE, dtype=np.int64)
        positions = np.zeros((len(indices), L), dtype=np.int64)
        for row, r in enumerate(indices):
            at = 0
            for i in range(self.row_ptr[r], self.row_ptr[r + 1]):
                a, n = int(self.starts[i]), int(self.lengths[i])
                piece = np.asarray(self.tokens[a:a + n + 1], dtype=np.int64)
                ids[row, at:at + n] = piece[:-1]
                target = piece[1:]
                if self.mask is not None:
                    target = np.where(np.asarray(self.mask[a + 1:a + n + 1], dtype=bool), target, IGNORE)
                labels[row, at:at + n] = target
                positions[row, at:at + n] = np.arange(n)
                at += n
            positions[row, at:] = np.arange(L - at)  # the padding: a piece of its own, without loss
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions)}

    def count_targets(self, indices) -> int:
        return int(self.targets[np.asarray(indices, dtype=np.int64)].sum())


class Subset:
    """A view of some sequences (the train or the validation part)."""

    def __init__(self, base, indices: np.ndarray):
        self.base, self.indices = base, np.asarray(indices, dtype=np.int64)

    def __len__(self):
        return len(self.indices)

    def get(self, positions) -> dict:
        return self.base.get(self.indices[np.asarray(positions, dtype=np.int64)])

    def count_targets(self, positions) -> int:
        return self.base.count_targets(self.indices[np.asarray(positions, dtype=np.int64)])


@dataclass
class DataSplits:
    train: Subset
    val: Subset
    fingerprint: str  # identity of the tokenized data + sequence length, carried in checkpoints
    num_tokens: int
    description: str
    tasks: tuple = ()  # data.kind=mixture: the sources' names (each batch row then carries its task index)
    sampler_cls: type = GlobalBatchSampler  # data=tokens: token_stores.LazyOrderSampler (no index arrays)
    reference_key: str = ""  # objective=dpo|ipo: the reference scores' key (trainer/objectives/reference.py)

    def sampler(self, global_batch_size: int, seed: int):
        """The global-batch sampler over the training split (trainer/data/sampler.py)."""
        return self.sampler_cls(len(self.train), global_batch_size, seed)


def build_data(cfg, tokenizer, vocab_size: int, log: Callable[[str], None] = print) -> DataSplits:
    d = cfg.data
    if d.follow:  # records read as they arrive (trainer/data/follow.py)
        return FollowData(d, tokenizer)
    if d.streaming:  # read and tokenized as training goes (trainer/data/streaming.py)
        evaluates = cfg.eval.every or cfg.eval.at_end or cfg.eval.at_start
        return StreamData(d, tokenizer, cfg.eval.max_sequences if evaluates else 0)
    if d.kind == "mixture":
        return build_mixture(d, [_build_source(dataclasses.replace(d, kind=src.kind, path=src.path,
                                                                   text_field=src.text_field, columns=src.columns,
                                                                   roles=src.roles, sources=[]),
                                               tokenizer, vocab_size, log, where=f"data.sources[{i}] ({src.name})")
                                 for i, src in enumerate(d.sources)])
    return _build_source(d, tokenizer, vocab_size, log)


def _build_source(d, tokenizer, vocab_size: int, log: Callable[[str], None], where: str = "") -> DataSplits:
    """The sequences of one data source, tokenized (cached) and split."""
    if d.kind == "tokens":
        return _token_store_source(d, tokenizer, vocab_size, log, where)
    cache_dir = d.cache_dir or default_cache_dir()
    if d.kind in sources.CHAT_KINDS:
        sft.ensure_chat_template(tokenizer, d.chat_template)
    key = {"source": sources.describe_source(d), "tokenizer": tokenizer_fingerprint(tokenizer),
           "kind": d.kind, "embedded": EMBEDDED_VERSION if d.kind == "embedded" else None}
    if d.kind in sources.CHAT_KINDS:
        key["render"] = sft.RENDER_VERSION
    note = (f"tokenization cache {cache_dir}: this run spans several nodes; nodes that share this folder tokenize "
            f"once, together, a node-local folder gets its own copy on each node (data.cache_dir=<a shared folder> "
            f"tokenizes once)") if env_spans_nodes() else ""
    if d.kind == "preference":  # built by one process per cache folder (no parts)
        store = build_or_load(cache_dir, key, "sft", vocab_size,
                              lambda: pair_items(preference_records(d), tokenizer), log, build_note=note)
    elif d.kind == "sft":
        store = build_or_load(cache_dir, key, "sft", vocab_size, lambda: _sft_items(d, tokenizer), log,
                              parts=lambda: _cache_parts(d, tokenizer), build_note=note)
    else:
        store = build_or_load(cache_dir, key, "text", vocab_size, lambda: _text_items(d, tokenizer), log,
                              parts=lambda: _cache_parts(d, tokenizer), build_note=note)
    seqs = _sequences(store, d, _pad_id(tokenizer), store.meta["kind"])
    prefix = f"{where}: " if where else ""
    if getattr(seqs, "dropped", 0):
        what = (f"preference pairs have a side longer than data.seq_len={d.seq_len} (+1) tokens or without a "
                f"response token" if d.kind == "preference" else
                f"SFT examples have no response token within data.seq_len={d.seq_len}")
        log(f"warning: {prefix}{seqs.dropped} {what} and are skipped")
    n = len(seqs)
    n_val = int(round(n * d.val_fraction)) if d.val_fraction > 0 else 0
    if d.val_fraction > 0 and n >= 2:
        n_val = max(1, n_val)
    if n - n_val < 1:
        raise DataError(f"{prefix}the data gives {n} sequence(s) of data.seq_len={d.seq_len} tokens "
                        f"({store.meta['num_tokens']} tokens in all): too few to train on; "
                        f"add data or lower data.seq_len")
    perm = np.random.Generator(np.random.PCG64(d.split_seed)).permutation(n)
    val_idx, train_idx = np.sort(perm[:n_val]), np.sort(perm[n_val:])
    fingerprint = f"{content_digest(store)}:L{d.seq_len}:v{d.val_fraction}:s{d.split_seed}"
    if d.packing != "eos":  # (eos adds nothing: checkpoints from before the key existed keep their identity)
        fingerprint += f":p{d.packing}"
    items = "pairs (2 rows)" if d.kind == "preference" else "sequences"
    desc = (f"{d.kind} data: {store.meta['num_documents']} documents, {store.meta['num_tokens']} tokens, "
            f"{len(train_idx)} train / {len(val_idx)} validation {items} of {d.seq_len} tokens")
    if d.packing == "documents":
        targets = seqs.count_targets(np.arange(n))
        desc += (f" ({seqs.num_pieces} documents or pieces packed with restarting positions; "
                 f"{targets / (n * d.seq_len):.1%} of the positions carry loss)")
    return DataSplits(Subset(seqs, train_idx), Subset(seqs, val_idx), fingerprint, store.meta["num_tokens"],
                      prefix + desc)


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _sequences(store: TokenStore, d, pad_id: int, kind: str):
    """A token store (a cache entry or one shard) cut into training sequences by data.packing."""
    if d.kind == "preference":
        return PreferencePairs(store, d.seq_len, pad_id)
    if d.packing == "documents":
        return DocumentPackedSequences(store, d.seq_len, pad_id)
    if kind == "sft":
        return SFTSequences(store, d.seq_len, pad_id)
    return PackedSequences(store, d.seq_len)


def _shard_count(folder: str, meta: dict, d, pad_id: int, kind: str) -> tuple:
    """(sequences, SFT examples dropped) of one shard; text with packing=eos is counted from the manifest."""
    if kind == "text" and d.packing == "eos":
        return max(0, (meta["num_tokens"] - 1) // d.seq_len), 0
    try:
        seqs = _sequences(TokenStore(folder, meta), d, pad_id, kind)
    except DataError:  # no sequence of this shard keeps a target token
        return 0, meta["num_documents"] if kind == "sft" else 0
    return len(seqs), getattr(seqs, "dropped", 0)


def _token_store_source(d, tokenizer, vocab_size: int, log, where: str) -> DataSplits:
    """data=tokens: sequences over sharded token stores, split and ordered without index arrays."""
    folders, metas, kind, digest = token_stores.open_stores(d.path, tokenizer, vocab_size)
    pad_id = _pad_id(tokenizer)
    counted = [_shard_count(f, m, d, pad_id, kind) for f, m in zip(folders, metas)]
    seqs = token_stores.ShardedSequences(folders, metas, [c for c, _ in counted],
                                         lambda store: _sequences(store, d, pad_id, kind))
    prefix = f"{where}: " if where else ""
    dropped = sum(x for _, x in counted)
    if dropped:
        log(f"warning: {prefix}{dropped} SFT examples have no response token within data.seq_len={d.seq_len} "
            f"and are skipped")
    n = len(seqs)
    n_val = max(1, int(round(n * d.val_fraction))) if d.val_fraction > 0 and n >= 2 else 0
    if n - n_val < 1:
        raise DataError(f"{prefix}the token store gives {n} sequence(s) of data.seq_len={d.seq_len} tokens: too few "
                        f"to train on; add data or lower data.seq_len")
    perm = token_stores.IndexPermutation(n, ("split", d.split_seed))
    fingerprint = f"tokens:{digest}:L{d.seq_len}:v{d.val_fraction}:s{d.split_seed}:p{d.packing}"
    tokens, docs = sum(m["num_tokens"] for m in metas), sum(m["num_documents"] for m in metas)
    desc = (f"token store ({kind}, {len(folders)} shards): {docs} documents, {tokens} tokens, {n - n_val} train / "
            f"{n_val} validation sequences of {d.seq_len} tokens")
    return DataSplits(token_stores.PermutedSubset(seqs, perm, n_val, n - n_val),
                      token_stores.PermutedSubset(seqs, perm, 0, n_val), fingerprint, tokens, prefix + desc,
                      sampler_cls=token_stores.LazyOrderSampler)


def content_digest(store: TokenStore, edge_bytes: int = 4 << 20) -> str:
    """Identity of the tokenized data by content (not by path or file times, so a copied corpus resumes):
    its token count and the first and last few MiB of its tokens (and response mask)."""
    h = hashlib.sha256(f"{store.meta['kind']}|{store.meta['num_tokens']}|{store.meta['dtype']}".encode())
    for arr in (store.tokens, store.mask):
        if arr is None:
            continue
        raw = np.asarray(arr).view(np.uint8)
        h.update(raw[:edge_bytes].tobytes())
        h.update(raw[-edge_bytes:].tobytes())
    return h.hexdigest()[:16]


CACHE_PART_BYTES, CACHE_PART_RECORDS = 16 << 20, 10_000  # a part of a cache entry that one process tokenizes


def _cache_parts(d, tokenizer):
    """The cache entry's items in parts (the token store's shards: trainer/data/tokenizing.py), tokenized by the
    ranks building it together; None where the items cannot be cut (plain-text files with data.max_records)."""
    src = tokenizing.open_source(d, tokenizer)
    if src.text_files and d.max_records is not None:
        return None
    return [functools.partial(tokenizing.shard_items, spec, src)
            for spec in tokenizing.shard_specs(src, CACHE_PART_BYTES, CACHE_PART_RECORDS)]


def _text_items(d, tokenizer):
    """(token ids, None, ends a document) per piece of text, in bounded batches (trainer/data/tokenizing.py)."""
    return encode_pieces(tokenizer, sources.iter_texts(d, lambda: embedded_documents(d.embedded_documents)))


def _sft_items(d, tokenizer):
    for _, conv in sources.iter_sft_records(d):
        yield sft.encode_conversation(tokenizer, conv.messages, conv.tools)
