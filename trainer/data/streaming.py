"""data.streaming=true: train on a source read as training goes, never tokenized whole (data=text files of any
size and number, data=hub datasets through `datasets` streaming).

The stream: the source's shards (a hub dataset's or a JSONL/parquet folder's files, through `datasets`
streaming; plain-text files cut every SHARD_BYTES, each cut moved to the next document start when the shard is
read, so start-up never reads the files) in an order drawn from
(train.seed, epoch), each shard's records in order, each record's text tokenized and followed by EOS, packed as
`data=text` packs: windows of data.seq_len + 1 tokens, each starting at the last token of the one before. Global
batch k is the stream's next train.global_batch_size windows; each data-parallel rank reads the whole stream and
keeps its slice, so what is trained never depends on the world size. After the last shard the next epoch starts
with a new shard order.

Held out: a record is validation when a hash of (data.split_seed, shard, record) falls under data.val_fraction;
the training stream skips those, and the validation split is the first eval.max_sequences windows packed from
them, shards in their natural order.

Exact resume: the stream position (epoch, shard slot, record, token within it) of the next window goes into every
checkpoint; a resumed run, at any world size, starts reading at that record and drops the tokens before it, so
it continues at the exact token. A background thread reads and tokenizes ahead (READ_AHEAD chunks).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from tessera.errors import DataError, one_line
from trainer.data import sources
from trainer.data.sampler import rank_slice
from trainer.data.store import tokenizer_fingerprint
from trainer.data.text_files import document_start_at, is_compressed, read_documents, text_pieces

SHARD_BYTES = 64 << 20  # plain-text files: the size of one shard (a byte range of whole documents)
BATCH_RECORDS, BATCH_CHARS = 256, 1_000_000  # records per tokenizer call, at most
READ_AHEAD = 8  # tokenized chunks the background reader keeps ready


@dataclass(frozen=True)
class Position:
    """Where the stream is: epoch, the slot in that epoch's shard order, the record within the shard, and the
    token within that record's tokens."""

    epoch: int = 0
    slot: int = 0
    record: int = 0
    token: int = 0

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "slot": self.slot, "record": self.record, "token": self.token}


def shard_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 0x53545245])))
    return rng.permutation(num_shards)


def held_out(split_seed: int, shard: int, record: int, val_fraction: float) -> bool:
    """Is this record validation? A hash of (split seed, shard, record), the same on every rank and run."""
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{split_seed}:{shard}:{record}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2 ** 64


# ---- the source ------------------------------------------------------------------------------------------------
def _quiet_datasets() -> None:
    """`datasets` logs a file it cannot parse as it reads; the read error becomes one DataError instead."""
    import datasets  # (loaded by sources.load_local / load_hub already)

    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)


class StreamSource:
    """A streamed source's shards, and the texts of one shard's records (each a list of pieces of at most
    data.max_document_chars, tokenized one by one and joined)."""

    def __init__(self, d):
        self.d = d
        self.ds, self.ranges = None, []
        if sources.reads_hub(d):
            self.where = f"data.name={d.name!r}"
            self.ds = sources.load_hub(d.name, d.config_name, d.split, d.revision, streaming=True)
            self.num_shards = self.ds.num_shards
            _quiet_datasets()
            return
        self.where = f"data.path={d.path!r}"
        files = sources.resolve_files(d.path)
        if sources.file_kind(files[0]) == "text":  # byte ranges, cut at document starts when read (no scan now)
            for f in files:
                size = os.path.getsize(f)
                self.ranges += [(f, 0, None)] if is_compressed(f) else \
                    [(f, a, min(a + SHARD_BYTES, size)) for a in range(0, size, SHARD_BYTES)]  # compressed: whole
            self.num_shards = len(self.ranges)
        else:
            self.ds = sources.load_local(files, streaming=True)
            self.num_shards = self.ds.num_shards
            _quiet_datasets()

    def records(self, shard: int, first: int = 0) -> Iterator[Tuple[int, List[str]]]:
        """(record index, its pieces) of `shard` from record `first` on; empty records are left out."""
        if self.ds is None:
            yield from self._documents(shard, first)
        else:
            yield from self._rows(shard, first)

    def _documents(self, shard: int, first: int):
        path, a, b = self.ranges[shard]
        sep = self.d.document_separator
        start, end = document_start_at(path, sep, a), None if b is None else document_start_at(path, sep, b)
        index, pieces = 0, []
        for piece in read_documents(path, self.d.document_separator, self.d.max_document_chars, start=start, end=end):
            if index >= first:
                pieces.append(piece.text)
            if piece.ends:
                if pieces:
                    yield index, pieces
                index, pieces = index + 1, []

    def _rows(self, shard: int, first: int):
        part = self.ds.shard(num_shards=self.num_shards, index=shard, contiguous=True)
        rows = part.skip(first) if first else part
        field = self.d.text_field
        try:
            for index, rec in enumerate(rows, start=first):
                value = rec.get(field)
                if not isinstance(value, str):
                    what = "no value" if value is None else f"a {type(value).__name__}, not text,"
                    raise DataError(f"{self.where}: record {index} of shard {shard} has {what} in field {field!r} "
                                    f"(set data.text_field)")
                if value:
                    yield index, [p.text for p in text_pieces(value, self.d.max_document_chars)]
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - datasets and its readers raise many types; one line for the user
            raise DataError(f"{self.where}: cannot read shard {shard}: {one_line(e.__cause__ or e)}") from None


# ---- reading ahead ---------------------------------------------------------------------------------------------
def training_records(source: StreamSource, seed: int, split_seed: int, val_fraction: float,
                     start: Position) -> Iterator[Tuple[Position, List[str]]]:
    """The training records from `start` on, epoch after epoch, each with its position (token 0)."""
    epoch, slot, record = start.epoch, start.slot, start.record
    while True:
        order, found = shard_order(source.num_shards, seed, epoch), False
        for s in range(slot, source.num_shards):
            shard = int(order[s])
            for index, pieces in source.records(shard, record):
                if not held_out(split_seed, shard, index, val_fraction):
                    found = True
                    yield Position(epoch, s, index), pieces
            record = 0
        if not found and slot == 0:
            raise DataError(f"{source.where}: a whole pass over the data found no training record (every record "
                            f"is empty or held out by data.val_fraction={val_fraction:g})")
        epoch, slot = epoch + 1, 0


def tokenized(tokenizer, records: Iterator[Tuple[Position, List[str]]]) -> Iterator[list]:
    """Chunks [(position, token ids with EOS), ...], tokenized BATCH_RECORDS records or BATCH_CHARS at a time."""
    batch, chars = [], 0
    for position, pieces in records:
        batch.append((position, pieces))
        chars += sum(len(p) for p in pieces)
        if len(batch) == BATCH_RECORDS or chars >= BATCH_CHARS:
            yield _encode(tokenizer, batch)
            batch, chars = [], 0
    if batch:
        yield _encode(tokenizer, batch)


def _encode(tokenizer, batch) -> list:
    texts = [p for _, pieces in batch for p in pieces]
    ids = iter(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
    out = []
    for position, pieces in batch:
        tokens = [t for _ in pieces for t in next(ids)]
        out.append((position, np.asarray(tokens + [tokenizer.eos_token_id], dtype=np.int64)))
    return out


class ReadAhead:
    """The chunks of an iterator, produced by a background thread READ_AHEAD chunks ahead; an error in the thread
    is raised where the chunk it stopped at is asked for."""

    def __init__(self, chunks: Iterator[list]):
        self._queue: queue.Queue = queue.Queue(maxsize=READ_AHEAD)
        self._closed = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(chunks,), name="tessera-stream-reader", daemon=True)
        self._thread.start()
        LIVE_READERS.add(self)

    def _run(self, chunks) -> None:
        try:
            for chunk in chunks:
                if not self._put(("chunk", chunk)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it
            self._put(("error", e))

    def _put(self, item) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> list:
        if self._error is not None:
            raise self._error
        kind, value = self._queue.get()
        if kind == "error":
            self._error = value
            raise value
        return value

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        LIVE_READERS.discard(self)


# Readers still running when the process exits are stopped first: a daemon thread left inside a reader of
# `datasets` / pyarrow while the interpreter finalizes can hang or abort the exit.
LIVE_READERS: "weakref.WeakSet[ReadAhead]" = weakref.WeakSet()


@atexit.register
def _close_live_readers() -> None:
    for reader in list(LIVE_READERS):
        reader.close()


# ---- the stream ------------------------------------------------------------------------------------------------
class TokenStream:
    """The training stream's tokens from its head on (the first token of the next window), read ahead in the
    background, and the head's Position."""

    def __init__(self, source: StreamSource, tokenizer, seed: int, split_seed: int, val_fraction: float):
        self.source, self.tokenizer = source, tokenizer
        self.seed, self.split_seed, self.val_fraction = seed, split_seed, val_fraction
        self.reader: Optional[ReadAhead] = None
        self.start(Position())

    def start(self, position: Position) -> None:
        """Read from `position` on (nothing is read until tokens are asked for)."""
        self.close()
        self.first = position
        self.buffer = np.empty(0, dtype=np.int64)  # stream tokens from buffer_start on (indices count from the
        self.head = self.buffer_start = 0         # first token of `first`'s record)
        self.marks: deque = deque()  # (Position of a record in the buffer, stream index of its first token)

    def _fill(self, tokens: int) -> None:
        """Read until the buffer holds `tokens` tokens from the head on."""
        if self.reader is None:
            records = training_records(self.source, self.seed, self.split_seed, self.val_fraction,
                                       Position(self.first.epoch, self.first.slot, self.first.record))
            self.reader = ReadAhead(tokenized(self.tokenizer, records))
            self.head = self.buffer_start = self.first.token
            self.end = 0  # stream index past the last token read
        parts = []
        while self.end - self.head < tokens:
            for position, ids in self.reader.next():
                self.marks.append((position, self.end))
                parts.append(ids)
                self.end += len(ids)
        if parts:
            joined = np.concatenate([self.buffer] + parts)
            self.buffer = joined[len(joined) - (self.end - self.buffer_start):]  # the first record: from first.token

    def take(self, n: int, seq_len: int) -> np.ndarray:
        """The next n windows [n, seq_len + 1]; the head moves n * seq_len tokens."""
        self._fill(n * seq_len + 1)
        at = self.head - self.buffer_start
        windows = np.stack([self.buffer[at + i * seq_len: at + i * seq_len + seq_len + 1] for i in range(n)])
        self.head += n * seq_len
        self.buffer, self.buffer_start = self.buffer[self.head - self.buffer_start:], self.head
        while len(self.marks) > 1 and self.marks[1][1] <= self.head:
            self.marks.popleft()
        return windows

    def position(self) -> Position:
        if not self.marks:
            return self.first
        record, start = self.marks[0]
        return Position(record.epoch, record.slot, record.record, self.head - start)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


class StreamSampler:
    """Global batch k: the stream's next train.global_batch_size windows, read when step k asks for them. Same
    interface as data/sampler.GlobalBatchSampler; its state is the stream's position."""

    def __init__(self, stream: TokenStream, train: "StreamRows", global_batch_size: int, seq_len: int):
        self.stream, self.train, self.gbs, self.seq_len = stream, train, global_batch_size, seq_len
        self.k: Optional[int] = None  # the step whose rows `train` holds
        self.before = Position()  # the stream's position before step k's rows were taken

    def bind(self, stop, watchdog, log, run_dir: str, step: int) -> None:
        """Nothing of the run is needed."""

    def epoch_of(self, k: int) -> int:
        return self.stream.position().epoch

    def global_batch(self, k: int) -> np.ndarray:
        if self.k != k:
            self.before = self.stream.position()
            self.train.rows = self.stream.take(self.gbs, self.seq_len)
            self.k = k
        return np.arange(self.gbs)

    def micro_batches(self, k: int, dp_rank: int, dp_size: int, micro_batch_size: int):
        local = rank_slice(self.global_batch(k), dp_rank, dp_size)
        return [local[i:i + micro_batch_size] for i in range(0, len(local), micro_batch_size)]

    def state_dict(self, consumed_batches: int) -> dict:
        # step k's rows taken but the step not trained (the checkpoint is at k): the position before them
        position = self.before if consumed_batches == self.k else self.stream.position()
        return {"consumed_batches": consumed_batches, "stream": position.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "stream" not in state:
            raise DataError("data.streaming=true: the checkpoint has no stream position (it was not saved by a "
                            "data.streaming run); start a new run")
        self.stream.start(Position(**{k: int(v) for k, v in state["stream"].items()}))
        self.k = None


class StreamRows:
    """Windows held in memory (the current step's rows, or the validation windows), read by position like any
    split."""

    def __init__(self, seq_len: int, rows: Optional[np.ndarray] = None):
        self.seq_len = seq_len
        self.rows = np.empty((0, seq_len + 1), dtype=np.int64) if rows is None else rows

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, positions) -> dict:
        rows = self.rows[np.asarray(positions, dtype=np.int64)]
        return {"input_ids": torch.from_numpy(rows[:, :-1].copy()), "labels": torch.from_numpy(rows[:, 1:].copy())}

    def count_targets(self, positions) -> int:
        return len(positions) * self.seq_len


def validation_rows(source: StreamSource, tokenizer, d, max_sequences: int) -> np.ndarray:
    """The first max_sequences windows packed from the held-out records, shards in natural order."""
    if d.val_fraction <= 0 or max_sequences <= 0:
        return np.empty((0, d.seq_len + 1), dtype=np.int64)

    def held() -> Iterator[Tuple[Position, List[str]]]:
        for shard in range(source.num_shards):
            for index, pieces in source.records(shard):
                if held_out(d.split_seed, shard, index, d.val_fraction):
                    yield Position(0, shard, index), pieces

    need, parts, count = max_sequences * d.seq_len + 1, [], 0
    for chunk in tokenized(tokenizer, held()):
        parts += [ids for _, ids in chunk]
        count += sum(len(ids) for _, ids in chunk)
        if count >= need:
            break
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    n = min(max_sequences, max(0, (len(tokens) - 1) // d.seq_len))
    L = d.seq_len
    return np.stack([tokens[i * L: i * L + L + 1] for i in range(n)]) if n else np.empty((0, L + 1), dtype=np.int64)


class StreamData:
    """DataSplits of a streamed source: the current step's rows as the training split, the held-out windows as
    the validation split."""

    def __init__(self, d, tokenizer, max_val_sequences: int):
        self.d, self.tokenizer = d, tokenizer
        self.source = StreamSource(d)
        next(self.source.records(0), None)  # a missing text field or an unreadable file: said now, not at step 1
        self.train = StreamRows(d.seq_len)
        self.val = StreamRows(d.seq_len, validation_rows(self.source, tokenizer, d, max_val_sequences))
        key = json.dumps({"stream": sources.describe_source(d), "seq_len": d.seq_len, "val": d.val_fraction,
                          "split_seed": d.split_seed, "tokenizer": tokenizer_fingerprint(tokenizer)}, sort_keys=True)
        self.fingerprint = "stream-" + hashlib.sha256(key.encode()).hexdigest()[:16]
        self.num_tokens = 0  # not known before the stream is read
        self.tasks = ()
        self.description = (f"streaming {self.source.where} ({self.source.num_shards} shards, read and tokenized "
                            f"as training goes by every rank, shard order reshuffled each epoch); "
                            f"{len(self.val)} validation sequences of {d.seq_len} tokens from held-out records")

    def sampler(self, global_batch_size: int, seed: int) -> StreamSampler:
        stream = TokenStream(self.source, self.tokenizer, seed, self.d.split_seed, self.d.val_fraction)
        return StreamSampler(stream, self.train, global_batch_size, self.d.seq_len)


def streaming_problems(cfg) -> List[str]:
    """data.streaming=true: what it reads and what it does not run with (before any process group)."""
    d = cfg.data
    if not d.streaming:
        return []
    problems = []
    if d.kind not in ("text", "hub"):
        problems.append(f"data.streaming=true reads text (data=text files or data=hub datasets); data.kind={d.kind} "
                        f"is not streamed" + (" (tokenize it once: python -m trainer.tokenize, then data=tokens)"
                                              if d.kind in ("sft", "mixture") else ""))
    if d.follow:
        problems.append("data.streaming=true and data.follow=true are two ways of reading; choose one")
    if d.packing != "eos":
        problems.append("data.streaming=true packs records with data.packing=eos; set data.packing=eos")
    if d.max_records is not None:
        problems.append("data.streaming=true reads every record each epoch; leave data.max_records unset (null) and "
                        "bound the run with train.max_steps")
    if cfg.strategy.fault_tolerance != "none":
        problems.append("data.streaming=true with strategy.fault_tolerance=torchft is not supported; use "
                        "strategy.fault_tolerance=none with train.max_restarts")
    if not cfg.eval.max_sequences and d.val_fraction > 0:
        problems.append("data.streaming=true: eval.max_sequences=0 (all) has no end on a stream; set the number of "
                        "validation sequences")
    return problems
