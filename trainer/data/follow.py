"""data.follow=true: train on records appended to a JSONL file, or to the *.jsonl files of a folder, while the
run is live (a model in service refreshed from new data).

The stream is the records in the order they are read (each file in name order, whole lines only: a line still
being written waits for its newline), each record's `data.text_field` tokenized and followed by EOS, packed as
`data=text` packs: sequence windows of `data.seq_len` + 1 tokens, each next one starting at the last token of
the one before, so every token after the first is a target once. Each global batch takes its fresh sequences from
the stream's head and, with `data.follow_replay` > 0, that fraction of its rows from records read earlier
(seeded by the step: the same rows on every rank and after a restart).

Exactly once: what was read (bytes per file) and the tokens read but not yet trained go into every checkpoint
(the loader state in meta.json); a resumed run continues from there, so no record is trained twice or skipped
across a kill and restart. `follow.jsonl` in the run directory lists, per step, the records whose last token that
step trained (file, byte offset), and is cut back to the checkpoint on resume like metrics.jsonl.

Waiting: with too little new data for a step, rank 0 looks at the files every `data.follow_poll_s` seconds and
tells the other ranks what it saw (one small broadcast per look; no rank spins); a stop signal, or
`data.follow_idle_timeout_s` without a new record, ends the run with a checkpoint. Records that are not JSON
objects with a string `data.text_field` are skipped and counted (a live stream does not stop on one bad line).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import time
from contextlib import nullcontext
from typing import Dict, List, Optional

import numpy as np
import torch.distributed as dist

from tessera.errors import DataError
from trainer.data.sampler import rank_slice
from trainer.data.store import tokenizer_fingerprint
from trainer.data.streaming import StreamRows
from trainer.observe.metrics import truncate_jsonl


READ_BYTES = 4 << 20  # per file and read


def _last_line_end(fh, start: int) -> int:
    """The offset just past the last newline of an open file at or after `start` (`start` if none), read
    backwards from its end in blocks (a file that grew by a lot is not read whole for it)."""
    size = fh.seek(0, os.SEEK_END)
    end = size
    while end > start:
        lo = max(start, end - (64 << 10))
        fh.seek(lo)
        block = fh.read(end - lo)
        cut = block.rfind(b"\n")
        if cut >= 0:
            return lo + cut + 1
        end = lo
    return start


def follow_files(path: str) -> List[str]:
    """The files followed: `path` itself, or the *.jsonl files of the folder `path`, in name order."""
    if os.path.isdir(path):
        return sorted(os.path.relpath(f, path) for f in glob.glob(os.path.join(path, "*.jsonl")))
    return [os.path.basename(path)]


class FollowStream:
    """The records read so far, the tokens not yet trained, and what each rank reads next."""

    def __init__(self, d, tokenizer):
        self.replays = d.follow_replay > 0  # keep the trained records' offsets (they only serve replay)
        self.root = d.path if os.path.isdir(d.path) else os.path.dirname(os.path.abspath(d.path))
        self.path, self.field, self.tokenizer = d.path, d.text_field, tokenizer
        self.eos = tokenizer.eos_token_id
        self.offsets: Dict[str, int] = {}  # file -> bytes read (whole lines)
        self.buffer = np.empty(0, dtype=np.int64)  # stream tokens from `position` on, not yet trained
        self.position = 0  # stream index of buffer[0]
        self.ends: List[list] = []  # [file, byte offset, stream index past its last token] of records in the buffer
        self.records: Dict[str, List[int]] = {}  # file -> byte offsets of its records trained (replay)
        self.skipped = 0

    # ---- reading --------------------------------------------------------------------------------------------
    def visible(self) -> Dict[str, int]:
        """Per file, the end of its last complete line (what may be read now). A file shorter than what was read
        of it (truncated, or replaced by another) is an error: only appended records are followed."""
        out = {}
        for name in follow_files(self.path):
            try:
                with open(os.path.join(self.root, name), "rb") as fh:
                    size = fh.seek(0, os.SEEK_END)
                    if size < self.offsets.get(name, 0):
                        raise DataError(f"data.follow: {os.path.join(self.root, name)} has {size} bytes, fewer than "
                                        f"the {self.offsets[name]} already read: it was truncated or "
                                        f"replaced. Only appended records are followed; append to it, or write new "
                                        f"records to a new file of the folder")
                    out[name] = _last_line_end(fh, self.offsets.get(name, 0))
            except FileNotFoundError:
                continue  # gone: what was read of it is trained, nothing more comes from it
        return out

    def read(self, limits: Dict[str, int]) -> int:
        """Read the files up to `limits` (whole lines, at most READ_BYTES of each per call: a large file is
        tokenized as training reaches it), in name order; returns the records read."""
        n = 0
        for name in sorted(limits):
            start, end = self.offsets.get(name, 0), limits[name]
            if end <= start:
                continue
            with open(os.path.join(self.root, name), "rb") as fh:
                fh.seek(start)
                chunk = fh.read(min(end - start, READ_BYTES))
                if start + len(chunk) < end:
                    cut = chunk.rfind(b"\n")
                    if cut < 0:  # one line longer than READ_BYTES: all of it
                        chunk += fh.read(end - start - len(chunk))
                        chunk = chunk[:chunk.find(b"\n", READ_BYTES - 1) + 1]
                    else:
                        chunk = chunk[:cut + 1]
            offset, texts, where = start, [], []
            for line in chunk.split(b"\n")[:-1]:
                text = self._text(line)
                if text is None:
                    self.skipped += bool(line.strip())
                else:
                    texts.append(text)
                    where.append(offset)
                offset += len(line) + 1
            if texts:
                ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
                pieces = [np.asarray(list(t) + [self.eos], dtype=np.int64) for t in ids]
                end_index = self.position + len(self.buffer)
                for off, piece in zip(where, pieces):
                    end_index += len(piece)
                    self.ends.append([name, off, end_index])
                self.buffer = np.concatenate([self.buffer] + pieces)
                n += len(texts)
            self.offsets[name] = start + len(chunk)
        return n

    def _text(self, line: bytes) -> Optional[str]:
        try:
            record = json.loads(line)
        except ValueError:
            return None
        text = record.get(self.field) if isinstance(record, dict) else None
        return text if isinstance(text, str) and text else None

    def take(self, n: int, seq_len: int):
        """n fresh sequences from the buffer's head -> (windows [n, seq_len + 1], records finished by them)."""
        windows = np.stack([self.buffer[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]) if n else \
            np.empty((0, seq_len + 1), dtype=np.int64)
        self.buffer = self.buffer[n * seq_len:]
        self.position += n * seq_len
        finished = 0  # records whose last token is now a target (`ends` is in stream order)
        while finished < len(self.ends) and self.ends[finished][2] <= self.position + 1:
            finished += 1
        done, self.ends = self.ends[:finished], self.ends[finished:]
        if self.replays:  # replay draws from trained records only: how far ahead was read never matters
            for name, off, _ in done:
                self.records.setdefault(name, []).append(off)
        return windows, [[name, off] for name, off, _ in done]

    def replayed(self, n: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
        """n sequences of records read earlier, each records drawn at random and joined until it is full."""
        names = sorted(self.records)
        counts = np.cumsum([len(self.records[f]) for f in names])
        rows = []
        for _ in range(n):
            row: List[int] = []
            while len(row) < seq_len + 1:
                i = int(rng.integers(counts[-1]))
                f = int(np.searchsorted(counts, i, side="right"))
                name = names[f]
                off = self.records[name][i - (counts[f - 1] if f else 0)]
                with open(os.path.join(self.root, name), "rb") as fh:
                    fh.seek(off)
                    text = self._text(fh.readline().rstrip(b"\n"))
                row += self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos]
            rows.append(row[:seq_len + 1])
        return np.asarray(rows, dtype=np.int64)

    # ---- checkpoint state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"offsets": dict(self.offsets), "buffer": self.buffer.tolist(), "position": self.position,
                "ends": [list(e) for e in self.ends], "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.offsets = {k: int(v) for k, v in state["offsets"].items()}
        self.buffer = np.asarray(state["buffer"], dtype=np.int64)
        self.position, self.skipped = int(state["position"]), int(state["skipped"])
        self.ends = [list(e) for e in state["ends"]]
        # the records trained before (replay): those read, less those still (partly) in the buffer
        pending = {(name, off) for name, off, _ in self.ends}
        self.records = {}
        for name, end in self.offsets.items() if self.replays else ():
            with open(os.path.join(self.root, name), "rb") as fh:
                offset = 0
                while offset < end:  # line by line: a long history is never read into memory at once
                    line = fh.readline()
                    if (name, offset) not in pending and self._text(line.rstrip(b"\n")) is not None:
                        self.records.setdefault(name, []).append(offset)
                    offset += len(line)


class FollowSampler:
    """Global batch k: `global_batch_size` rows, the replayed ones first, read from the stream when step k asks
    for them (waiting for new records if needed). Same interface as data/sampler.GlobalBatchSampler."""

    def __init__(self, stream: FollowStream, train: StreamRows, d, global_batch_size: int, seed: int):
        self.stream, self.train, self.d = stream, train, d
        self.gbs, self.seed, self.seq_len = global_batch_size, seed, d.seq_len
        self.n_replay = int(round(d.follow_replay * global_batch_size))
        self.k = None  # the step whose rows `train` holds
        self.stop = self.watchdog = self.log = None
        self.log_path = None

    def bind(self, stop, watchdog, log, run_dir: str, step: int) -> None:
        """The run's stop request, watchdog and log (one line); follow.jsonl cut back to the run's step (a
        resume)."""
        self.stop, self.watchdog, self.log = stop, watchdog, log
        if not dist.is_initialized() or dist.get_rank() == 0:
            self.log_path = os.path.join(run_dir, "follow.jsonl")
            truncate_jsonl(self.log_path, lambda s: s <= step)

    def epoch_of(self, k: int) -> int:
        return 0

    def global_batch(self, k: int) -> Optional[np.ndarray]:
        """The rows of step k (None: the run ends: a stop signal or the idle limit while waiting)."""
        if self.k == k:
            return np.arange(len(self.train))
        n_replay = self.n_replay if self.stream.records else 0
        fresh = self.gbs - n_replay
        if not self._wait_for(fresh * self.seq_len + 1):
            return None
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, k])))
        replay = self.stream.replayed(n_replay, self.seq_len, rng) if n_replay else None
        windows, done = self.stream.take(fresh, self.seq_len)
        self.train.rows = windows if replay is None else np.concatenate([replay, windows])
        self.k = k
        if self.log_path:
            with open(self.log_path, "a") as fh:
                fh.write(json.dumps({"step": k + 1, "records": done, "replayed_rows": n_replay,
                                     "skipped_records": self.stream.skipped}) + "\n")
        return np.arange(len(self.train))

    def micro_batches(self, k: int, dp_rank: int, dp_size: int, micro_batch_size: int):
        local = rank_slice(self.global_batch(k), dp_rank, dp_size)
        return [local[i:i + micro_batch_size] for i in range(0, len(local), micro_batch_size)]

    def _wait_for(self, tokens: int) -> bool:
        """Read until the buffer holds `tokens`; every rank reads what rank 0 saw. False: stop instead."""
        waited, last_new, told = False, time.monotonic(), False
        exempt = self.watchdog.exempt("waiting for new records") if self.watchdog is not None else nullcontext()
        with exempt:
            while len(self.stream.buffer) < tokens:
                rank0 = not dist.is_initialized() or dist.get_rank() == 0
                idle = self.d.follow_idle_timeout_s
                message = [None, False, None]
                if rank0:
                    try:
                        message = [self.stream.visible(), bool(idle and time.monotonic() - last_new > idle), None]
                    except DataError as e:
                        message[2] = str(e)  # every rank stops with it, none waits in the broadcast
                if dist.is_initialized() and dist.get_world_size() > 1:
                    dist.broadcast_object_list(message, src=0)
                limits, idle_out, problem = message
                if problem:
                    raise DataError(problem)
                if self.stream.read(limits):
                    last_new = time.monotonic()
                    continue
                if self.stop is not None and self.stop.agreed():
                    return False
                if idle_out:
                    if self.log:
                        self.log(f"no new record in {self.d.path} for {idle:g}s: ending the run")
                    return False
                if not told and self.log:
                    self.log(f"waiting for new records in {self.d.path} ({len(self.stream.buffer)} of {tokens} "
                             f"tokens for the next step)")
                    told = True
                waited = True
                time.sleep(self.d.follow_poll_s)
        if waited and self.log:
            self.log("new records: training goes on")
        return True

    def state_dict(self, consumed_batches: int) -> dict:
        return {"consumed_batches": consumed_batches, "follow": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "follow" not in state:
            raise DataError("data.follow=true: the checkpoint has no stream position (it was not saved by a "
                            "data.follow run); start a new run")
        self.stream.load_state_dict(state["follow"])
        self.k = None


class FollowData:
    """DataSplits of a followed source: the current step's rows as the training split, no validation split."""

    def __init__(self, d, tokenizer):
        self.d, self.tokenizer = d, tokenizer
        self.train = StreamRows(d.seq_len)  # the current step's rows
        self.val = StreamRows(d.seq_len)  # empty: every record trains
        key = json.dumps({"follow": os.path.abspath(d.path), "field": d.text_field, "seq_len": d.seq_len,
                          "tokenizer": tokenizer_fingerprint(tokenizer)}, sort_keys=True)
        self.fingerprint = "follow-" + hashlib.sha256(key.encode()).hexdigest()[:16]
        self.num_tokens = 0
        self.tasks = ()
        replay = f", {d.follow_replay:g} of each batch replayed" if d.follow_replay else ""
        self.description = (f"following {d.path} (records appended while the run is live, each trained once"
                            f"{replay}); no validation split")

    def sampler(self, global_batch_size: int, seed: int) -> FollowSampler:
        return FollowSampler(FollowStream(self.d, self.tokenizer), self.train, self.d, global_batch_size, seed)


def follow_problems(cfg) -> List[str]:
    """data.follow=true: what it reads and what it does not run with (before any process group)."""
    d = cfg.data
    if not d.follow:
        return []
    problems = []
    if d.kind != "text":
        problems.append(f"data.follow=true reads JSONL records of text (data.kind=text); data.kind={d.kind} is not "
                        f"followed")
    elif not d.path or not (os.path.isdir(d.path) or os.path.isfile(d.path)):
        problems.append(f"data.follow=true: data.path={d.path!r} does not exist; point it at the JSONL file or the "
                        f"folder of *.jsonl files that records are appended to")
    elif os.path.isfile(d.path) and not d.path.endswith(".jsonl"):
        problems.append(f"data.follow=true reads records appended as lines to a .jsonl file: data.path={d.path!r} "
                        f"is not one (a compressed or other file is read with data.follow=false)")
    if d.packing != "eos":
        problems.append("data.follow=true packs records with data.packing=eos; set data.packing=eos")
    if cfg.strategy.fault_tolerance != "none":
        problems.append("data.follow=true with strategy.fault_tolerance=torchft is not supported (each replica group "
                        "would wait for records on its own); use strategy.fault_tolerance=none with "
                        "train.max_restarts")
    if cfg.eval.every:
        problems.append(f"data.follow=true has no validation split (every record trains); set eval.every=0 "
                        f"(got {cfg.eval.every})")
    return problems
