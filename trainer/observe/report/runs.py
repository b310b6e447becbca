"""Finding run directories (a run, or a folder of runs such as a Hydra sweep) and reading what each one logged.

Nothing here imports torch: a report of finished runs starts in a moment."""
from __future__ import annotations

import fcntl
import json
import os
import re
from dataclasses import dataclass
from typing import List, Optional

import yaml

from tessera.errors import TesseraError, one_line

METRICS = "metrics.jsonl"
EVALS = "eval.jsonl"
MEMORY = "memory.json"
HYDRA = ".hydra"
# trainer/resilience/rundir.py's LOCK_NAME: rank 0 flocks it for the job's life (not imported: that module loads
# torch through the checkpoint manager).
LOCK = ".lock"


class ReportError(TesseraError):
    """A path that is neither a run nor a folder of runs, or a run file that cannot be read (exit 2)."""


@dataclass
class Run:
    """What one run directory holds, as the report reads it."""

    path: str  # absolute
    name: str  # how the report names it: its folder, or its path below the runs' common folder
    metrics: List[dict]  # metrics.jsonl, in order
    evals: List[dict]  # eval.jsonl, in order
    config: dict  # the resolved config.yaml ({} when missing)
    overrides: Optional[List[str]]  # .hydra/overrides.yaml (None when missing)
    memory: Optional[dict]  # memory.json (logging.memory_report=true)
    live: bool  # a job holds the run directory's lock now


def is_run(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METRICS)) or os.path.isdir(os.path.join(path, HYDRA))


def find_runs(paths: List[str]) -> List[str]:
    """The run directories the arguments name, in order, each once (absolute): an argument that is a run is
    itself, any other folder stands for the runs below it (a Hydra sweep: `<sweep dir>/<job number>/`)."""
    found: List[str] = []
    for given in paths:
        path = os.path.abspath(given)
        if not os.path.exists(path):
            raise ReportError(f"{given} does not exist: pass run directories, or folders holding them (a sweep)")
        if not os.path.isdir(path):
            raise ReportError(f"{given} is not a folder: pass run directories, or folders holding them (a sweep)")
        runs = [path] if is_run(path) else runs_below(path)
        if not runs:
            raise ReportError(f"no run directories under {given}: a run directory holds {METRICS} or {HYDRA}/")
        found += [r for r in runs if r not in found]
    return found


def runs_below(root: str) -> List[str]:
    """The run directories under `root`, in natural order (job 2 before job 10); a run's own folders
    (checkpoints, previous-* runs moved aside) are not searched."""
    runs = []
    for folder, dirs, _ in os.walk(root):
        keep = []
        for d in dirs:
            if d.startswith("."):
                continue  # .hydra/, .heartbeat/, .submitit/: never a run
            (runs if is_run(os.path.join(folder, d)) else keep).append(os.path.join(folder, d))
        dirs[:] = [os.path.basename(d) for d in keep]
    return sorted(runs, key=lambda p: _natural(os.path.relpath(p, root)))


def _natural(text: str):
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part]


def run_names(paths: List[str]) -> List[str]:
    """One run: its folder's name; several: each one's path below their deepest common folder."""
    if len(paths) == 1:
        return [os.path.basename(paths[0])]
    root = os.path.commonpath(paths)
    return [os.path.relpath(p, root) if p != root else os.path.basename(p) for p in paths]


def read_runs(paths: List[str]) -> List[Run]:
    return [read_run(path, name) for path, name in zip(paths, run_names(paths))]


def read_run(path: str, name: str) -> Run:
    overrides = read_yaml(os.path.join(path, HYDRA, "overrides.yaml"))
    config = read_yaml(os.path.join(path, "config.yaml"))
    if config is None:  # Hydra's own copy: a job that failed before the trainer wrote config.yaml
        config = read_yaml(os.path.join(path, HYDRA, "config.yaml"))
    return Run(path=path, name=name, metrics=read_jsonl(os.path.join(path, METRICS)),
               evals=read_jsonl(os.path.join(path, EVALS)), config=config if isinstance(config, dict) else {},
               overrides=[str(o) for o in overrides] if isinstance(overrides, list) else None,
               memory=read_json(os.path.join(path, MEMORY)), live=holds_lock(path))


def read_jsonl(path: str) -> List[dict]:
    """The records of a JSONL log ([] when there is none). A last line cut short by a crash (no newline after it)
    is skipped, as trainer/observe/metrics.py's truncate_jsonl drops it; any other line that is not a JSON object
    with an integer `step` is an error naming the file and the line."""
    data = _read_bytes(path)
    if data is None:
        return []
    lines = data.split(b"\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip(b" \t\r\x00"):
            continue
        record = _record(line)
        if record is not None:
            records.append(record)
        elif number < len(lines):  # a complete line (a newline follows it) that does not parse
            raise ReportError(f"{path} line {number} is not a JSON object with an integer step: {_excerpt(line)}; "
                              f"pass a run directory written by the trainer")
    return records


def _record(line: bytes) -> Optional[dict]:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(record, dict) and isinstance(record.get("step"), int) and not isinstance(record["step"], bool)
    return record if ok else None


def _excerpt(line: bytes) -> str:
    text = line.decode("utf-8", "replace").strip()
    return repr(text if len(text) <= 60 else text[:57] + "...")


def _read_bytes(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ReportError(f"cannot read {path}: {one_line(e)}") from None


def read_yaml(path: str):
    data = _read_bytes(path)
    if data is None:
        return None
    try:
        return yaml.safe_load(data)
    except yaml.YAMLError as e:
        raise ReportError(f"{path} is not valid YAML: {one_line(e)}") from None


def read_json(path: str):
    data = _read_bytes(path)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError as e:
        raise ReportError(f"{path} is not valid JSON: {one_line(e)}") from None


def holds_lock(path: str) -> bool:
    """Whether a job holds the run directory's lock now, i.e. the run is still going (a shared lock, taken and
    dropped at once, is refused while rank 0 holds its exclusive one)."""
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False  # a file system without locks: unknown, reported as not running
    finally:
        os.close(fd)
