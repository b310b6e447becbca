"""Reading back what the experiment trackers hold, with the real libraries' own formats (tests only).

W&B: an offline run is a transaction log, `<wandb dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb` (one per
launch that continued the run), in the LevelDB log format that wandb-core writes (`core/pkg/leveldb` in the wandb
repository; `wandb sync` reads the same): a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks
of chunks, each a 7-byte header (CRC-32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes, a record
being one protobuf `wandb_internal_pb2.Record`. (wandb 0.31 has no Python reader of its own any more.)

MLflow: `MlflowClient(tracking_uri).get_metric_history(run_id, key)`.
"""
from __future__ import annotations

import glob
import json
import os
import struct
import time
from typing import Dict, Iterator, List, Tuple

BLOCK = 32768
HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: str) -> Iterator[object]:
    """Every Record of one .wandb transaction log, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as fh:
        data = fh.read()
    ident, magic, version = HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, parts = HEADER.size, []
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        parts.append(data[pos + CHUNK.size:pos + CHUNK.size + length])
        pos += CHUNK.size + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def wandb_logs(wandb_dir: str, run_id: str) -> List[str]:
    """The transaction logs of run `run_id` under `wandb_dir` (the folder that holds `wandb/`), oldest first."""
    return sorted(glob.glob(os.path.join(wandb_dir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb")))


def wandb_history(wandb_dir: str, run_id: str) -> List[Tuple[int, Dict[str, float]]]:
    """(step, {key: value}) of every history row of the run, over all its launches, in the order written (W&B's own
    keys, `_step`, `_runtime`, `_timestamp`, left out)."""
    rows = []
    for path in wandb_logs(wandb_dir, run_id):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            values = {}
            for item in record.history.item:
                key = "/".join(item.nested_key) if item.nested_key else item.key
                if not key.startswith("_"):
                    values[key] = json.loads(item.value_json)
            rows.append((record.history.step.num, values))
    return rows


def wandb_run_ids(wandb_dir: str, launches: int = 0, timeout: float = 30.0) -> List[str]:
    """The run ids of every offline run under `wandb_dir` (one entry per launch). With `launches`, read again until
    that many launches' logs hold their run record (W&B's service process writes them; on a loaded machine it
    can finish after the run's finish() returned), for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        ids = _wandb_run_ids(wandb_dir)
        if len(ids) >= launches or time.monotonic() > deadline:
            return ids
        time.sleep(0.2)


def _wandb_run_ids(wandb_dir: str) -> List[str]:
    out = []
    for path in sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "run":
                out.append(record.run.run_id)
                break
    return out


def wandb_summary(wandb_dir: str, run_id: str) -> Dict[str, object]:
    """The run's summary entries as its last launch left them (the later update of a key wins)."""
    out = {}
    for path in wandb_logs(wandb_dir, run_id):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "summary":
                for item in record.summary.update:
                    key = "/".join(item.nested_key) if item.nested_key else item.key
                    out[key] = json.loads(item.value_json)
    return out


def mlflow_history(tracking_uri: str, run_id: str, key: str) -> List[Tuple[int, float]]:
    """(step, value) of one metric of an MLflow run, in step order."""
    from mlflow.tracking import MlflowClient

    history = MlflowClient(tracking_uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in history)


def mlflow_run(tracking_uri: str, run_id: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri).get_run(run_id)
