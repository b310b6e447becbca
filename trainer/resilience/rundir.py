"""The run directory belongs to one run, and to one live job at a time.

`claim(run_dir, plan, overwrite)` runs in `prepare`, before any process group exists, on every rank:

1. The lock. Global rank 0 takes `<run dir>/.lock` (an `fcntl.flock`, held until `release` or the end of the
   process; the kernel drops it when the process dies, so a lock left by a dead job never blocks) and writes a
   JSON body naming its host, pid, start time and command. A second job in the same folder is refused with one
   message naming the holder. Other ranks do not take the lock (on a shared file system every node's lock would
   be the same one): on the holder's host they look at it, and a lock held by another job refuses them too, so
   no rank is left waiting for a rank 0 that gave up.
2. One run per folder. A new run (`checkpoint.resume=none`, or a checkpoint path outside the folder, or
   `load_weights_only`) in a folder that holds another run's checkpoints (complete or partial) or logs is
   refused: every rank decides the same from the same files. With `checkpoint.overwrite=true` rank 0 moves that
   run's files (everything but Hydra's `.hydra/`, the lock, launch logs `*.log` and earlier `previous-*`) into
   `<run dir>/previous-<time>/` under the lock; nothing is deleted. Rank 0 writes the lock's body only after
   that, so the other ranks, waiting for the body that names their own job, wait for the move too.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from typing import Dict, List, Optional

from trainer.checkpoint import manager as ckpt
from trainer.config.compose import process_start_time
from trainer.parallel import dims as parallel
from tessera.errors import FaultError, TesseraError, one_line

LOCK_NAME = ".lock"
PREVIOUS_PREFIX = "previous-"
LOGS = ("metrics.jsonl", "eval.jsonl", "follow.jsonl")
KEPT = (".hydra", LOCK_NAME)  # never moved aside: Hydra's files of this launch, the lock itself
RANK0_WAIT_S = 2.0  # rank 0 retries its lock this long (another rank's look at the lock takes microseconds)
OTHER_RANK_WAIT_S = 5.0  # other ranks wait this long for their rank 0 to write the lock's body

_HELD: Dict[str, int] = {}  # run dir (absolute) -> the open, flock-ed .lock of this process


class RunDirError(TesseraError):
    """The run directory holds another run, or another job is running in it (exit 2)."""

    same_on_every_rank = True  # every rank decides from the same files


# ----------------------------------------------------------------------------------------------------------
# What is in the folder.

def leftovers(run_dir: str) -> List[str]:
    """The files of an earlier run in `run_dir` (relative names): checkpoints (complete or partial), non-empty
    metrics/eval logs, an exported model, snapshots."""
    found = []
    root = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(root):
        names = [n for n in os.listdir(root) if ckpt.STEP_RE.match(n) or n.startswith(ckpt.TMP_PREFIX)]
        found += [f"checkpoints/{n}" for n in sorted(names, key=_step_of)]
    for name in LOGS:
        try:
            if os.path.getsize(os.path.join(run_dir, name)) > 0:
                found.append(name)
        except OSError:
            pass
    for name in ("hf", "hf-adapter", "snapshots"):  # exports (hf-adapter/: peft=lora), live snapshots
        folder = os.path.join(run_dir, name)
        if os.path.isdir(folder) and os.listdir(folder):
            found.append(f"{name}/")
    return found


def _step_of(name: str) -> int:
    digits = name.rsplit("_", 1)[-1]
    return int(digits) if digits.isdigit() else -1


def refusal(plan, run_dir: str, found: List[str]) -> str:
    """Why a new run (`plan`: trainer/checkpoint/resume_plan.py) may not start in a folder holding `found`."""
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    what = plan.describe()
    return (f"the run directory {run_dir} holds another run ({shown}); a new run ({what}) there would overwrite "
            f"its checkpoints and mix the two runs' logs. Continue that run with checkpoint.resume=auto, start this "
            f"one in another hydra.run.dir=<folder>, or set checkpoint.overwrite=true to move the old run's files "
            f"aside to {os.path.join(run_dir, PREVIOUS_PREFIX)}<time>/ (nothing is deleted)")


def move_aside(run_dir: str) -> str:
    """Move everything of the earlier run into `<run dir>/previous-<time>/`; returns that folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = os.path.join(run_dir, PREVIOUS_PREFIX + stamp), 1
    while os.path.exists(dest):
        dest, n = os.path.join(run_dir, f"{PREVIOUS_PREFIX}{stamp}-{n}"), n + 1
    src = dest
    try:
        os.mkdir(dest)
        for name in sorted(os.listdir(run_dir)):
            src = os.path.join(run_dir, name)
            if (name in KEPT or name.startswith(PREVIOUS_PREFIX)
                    or (name.endswith(".log") and os.path.isfile(src))):
                continue
            os.rename(src, os.path.join(dest, name))
    except OSError as e:
        why = e.strerror or one_line(e)
        raise FaultError(f"checkpoint.overwrite=true: moving {src} aside to {dest} failed: {why}; nothing was "
                         f"deleted, check the folder's permissions") from None
    return dest


# ----------------------------------------------------------------------------------------------------------
# The lock.

def job_token() -> str:
    """The same on every rank of one launch, different between launches. Under torchrun: the rendezvous (run id
    and the process group's address, the same on every node, also for two agents of one elastic job on one
    host); a job of several nodes: the process group's address; otherwise the launcher process on this host
    (deepspeed's launcher) and its start time; a lone process is its own job."""
    host = socket.gethostname()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return (f"torchrun:{os.environ['TORCHELASTIC_RUN_ID']}:{os.environ.get('MASTER_ADDR', '')}:"
                f"{os.environ.get('MASTER_PORT', '')}")
    if parallel.env_spans_nodes():
        # several nodes, each with a launcher of its own (the deepspeed launcher's --no_ssh): the process group's
        # address is what they share (and no other live job can listen on it)
        return f"nodes:{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    if parallel.env_world_size() > 1 or "LOCAL_RANK" in os.environ:
        ppid = os.getppid()
        return f"{host}:{ppid}:{process_start_time(ppid)}"
    return f"{host}:{os.getpid()}"


def _body() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %z"), "started": round(time.time(), 3),
            "command": " ".join(getattr(sys, "orig_argv", sys.argv)), "job": job_token()}


def _read_body(fd: int) -> Optional[dict]:
    try:
        data = os.pread(fd, 65536, 0)
        body = json.loads(data.decode()) if data.strip() else None
        return body if isinstance(body, dict) else None
    except (OSError, ValueError):
        return None


def holder_message(run_dir: str, body: Optional[dict]) -> str:
    path = os.path.join(run_dir, LOCK_NAME)
    if not body:
        who = f"another process holds its lock {path}"
    else:
        command = str(body.get("command", ""))
        command = command if len(command) <= 160 else command[:157] + "..."
        who = (f"pid {body.get('pid')} on host {body.get('host')}, running since {body.get('since')} "
               f"(`{command}`), holds its lock {path}")
    return (f"another job is running in the run directory {run_dir}: {who}. Wait for it to end or stop it, or "
            f"start this job in another hydra.run.dir=<folder>")


def _acquire(run_dir: str) -> int:
    """Rank 0: flock the run directory's lock (not yet writing its body); the open file, or -1 where the file
    system has no locks."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise FaultError(f"cannot create the run directory's lock {path}: {e.strerror or one_line(e)}; the folder "
                         f"must be writable (or choose another hydra.run.dir)") from None
    deadline = time.monotonic() + RANK0_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                body = _read_body(fd)
                os.close(fd)
                raise RunDirError(holder_message(run_dir, body)) from None
            time.sleep(0.02)
        except OSError as e:  # ENOLCK / EOPNOTSUPP: a file system without locks
            os.close(fd)
            print(f"warning: cannot lock {path} ({e.strerror or one_line(e)}): a second job in this run directory "
                  f"would not be refused", file=sys.stderr, flush=True)
            return -1


def _publish(fd: int) -> None:
    data = (json.dumps(_body()) + "\n").encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError as e:
        raise FaultError(f"cannot write the run directory's lock: {e.strerror or one_line(e)} (disk full or "
                         f"read-only?)") from None


def _look_from_other_rank(run_dir: str) -> None:
    """A rank other than 0: refuse when another job (not this one's rank 0) holds the lock; wait a moment for
    this job's rank 0 when the lock is held but its body names another job (rank 0 writes it right after
    deciding, and after moving an old run aside)."""
    path = os.path.join(run_dir, LOCK_NAME)
    token, host = job_token(), socket.gethostname()
    deadline = time.monotonic() + OTHER_RANK_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return  # no lock yet: rank 0 will take it (or refuse, on its own)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return  # nobody holds it
            except BlockingIOError:
                body = _read_body(fd)
            except OSError:
                return  # no locks on this file system
        finally:
            os.close(fd)
        if body is not None and (body.get("job") == token or body.get("host") != host):
            return  # our rank 0 (or a holder elsewhere, which our rank 0 judges)
        if time.monotonic() > deadline:
            raise RunDirError(holder_message(run_dir, body))
        time.sleep(0.05)


def claim(run_dir: str, plan, overwrite: bool) -> None:
    """Lock the run directory (rank 0) and make sure this launch does not mix with another run in it: `plan` (the
    resume plan, trainer/checkpoint/resume_plan.py) says whether it continues the folder's run; `overwrite`
    (checkpoint.overwrite) moves another run's files aside instead of refusing."""
    run_dir = os.path.abspath(run_dir)
    rank0 = parallel.env_rank() == 0
    if not rank0:
        _look_from_other_rank(run_dir)  # first: a refused rank 0 (the same refusal) never publishes a body
        _check_contents(plan, overwrite, run_dir, move=False)
        return
    if run_dir in _HELD:  # this process holds it already (an in-process caller preparing again)
        _check_contents(plan, overwrite, run_dir, move=True)
        return
    fd = _acquire(run_dir)
    try:
        _check_contents(plan, overwrite, run_dir, move=True)
        if fd >= 0:
            _publish(fd)
    except BaseException:
        if fd >= 0:
            os.close(fd)  # closing the only descriptor drops the lock
        raise
    if fd >= 0:
        _HELD[run_dir] = fd


def _check_contents(plan, overwrite: bool, run_dir: str, move: bool) -> None:
    found = leftovers(run_dir) if os.path.isdir(run_dir) else []
    if not found or plan.continues_run:
        return
    if not overwrite:
        raise RunDirError(refusal(plan, run_dir, found))
    if move:
        dest = move_aside(run_dir)
        print(f"checkpoint.overwrite=true: moved the earlier run's files ({', '.join(found[:4])}"
              f"{' ...' if len(found) > 4 else ''}) to {dest}", flush=True)


def release(run_dir: str) -> None:
    """Drop the lock this process holds on `run_dir` (its file stays; a lock nobody holds never blocks)."""
    fd = _HELD.pop(os.path.abspath(run_dir), None)
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def held() -> List[str]:
    """The run directories (absolute) this process holds locked."""
    return list(_HELD)
