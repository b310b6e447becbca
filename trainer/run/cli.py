"""What the entry point needs before Hydra sees the command line: launcher argv quirks, one run directory
for all ranks, and turning user errors into one message and a non-zero exit."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from trainer.config.compose import compose_job
from tessera.errors import EXIT_BAD_INPUT, EXIT_FAULT, TesseraError, one_line


def sanitize_argv(argv: list) -> list:
    """Drop the `--local_rank=N` / `--local-rank N` that the deepspeed launcher appends (the rank comes from
    the environment), and keep Hydra's `.hydra/` output on rank 0 only."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.startswith(("--local_rank=", "--local-rank=")):
            continue
        if arg in ("--local_rank", "--local-rank"):
            skip = i + 1 < len(argv)
            continue
        out.append(arg)
    if int(os.environ.get("RANK", "0")) != 0 and not any(a.startswith("hydra.output_subdir") for a in out):
        out.append("hydra.output_subdir=null")
    if out and os.path.basename(out[0]) == "main.py":  # the training entry point: Hydra creates the run dir next
        run_dir_preflight(out)
    return out


def unwritable(folder: str):
    """Why `folder` (existing or to be created) cannot be written, or None: the nearest existing ancestor must
    be a writable folder (os.access: EROFS on a read-only file system, EACCES for a non-root user)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not os.path.isdir(path):
        return f"{path} is not a folder"
    if not os.access(path, os.W_OK | os.X_OK):
        import errno

        try:  # tell a read-only file system from a permission problem
            st = os.statvfs(path)
            if st.f_flag & os.ST_RDONLY:
                return f"{path} is on a read-only file system"
        except OSError:
            pass
        return f"{path} is not writable ({os.strerror(errno.EACCES).lower()})"
    return None


def writable_problems(cfg, run_dir: str) -> list:
    """Folders the run writes, checked up front (prepare): one problem per folder, naming the key to change."""
    # here, not at the top: main.py imports this module first, before anything heavy (numpy via the store)
    from trainer.data.store import default_cache_dir

    problems = []
    why = unwritable(run_dir)
    if why:
        problems.append(f"hydra.run.dir={run_dir}: {why}; set hydra.run.dir to a writable folder")
    cache = cfg.data.cache_dir or default_cache_dir()
    why = unwritable(cache)
    if why:
        key = "data.cache_dir" if cfg.data.cache_dir else "the tokenization cache (TESSERA_CACHE, or data.cache_dir)"
        problems.append(f"{key}={cache}: {why}; set data.cache_dir (or TESSERA_CACHE) to a writable folder")
    return problems


def run_dir_preflight(argv) -> None:
    """Before Hydra creates the run directory (it would fail with a traceback): an explicit hydra.run.dir that
    can't be written ends here with one message and exit code 2."""
    for arg in argv[1:]:
        if arg.startswith("hydra.run.dir="):
            folder = arg.split("=", 1)[1]
            why = unwritable(folder) if folder and "${" not in folder else None
            if why:  # every rank is given the same folder
                exit_with(f"hydra.run.dir={folder}: {why}; set hydra.run.dir to a writable folder", EXIT_BAD_INPUT,
                          same_on_every_rank=True)


NOISE = ("object_type", "reference_type", "full_key", "provider=", "To append to your config")


def hydra_flags(argv) -> bool:
    """Hydra's own flags (--cfg, --help, -m ...) or a hydra.mode are on the command line: @hydra.main handles
    them (a sweep composes per job)."""
    return any(a.startswith(("-", "hydra.mode=")) for a in argv[1:])


def compose_or_exit(argv):
    """The entry's one compose of the command line (trainer/config/compose.py: compose_job): a problem (an unknown
    key, a wrong type, a missing group option, an override that does not parse) ends here with one message and exit
    code 2, where Hydra would print its own report and exit 1."""
    try:
        return compose_job(argv[1:])
    except COMPOSE_ERRORS as e:
        exit_with(compose_message(e), EXIT_BAD_INPUT, same_on_every_rank=True)


COMPOSE_ERRORS = (HydraException, OmegaConfBaseException, ValueError)


def compose_message(e: BaseException) -> str:
    """One message for a composition problem (one of COMPOSE_ERRORS): Hydra's lines without its noise, naming the
    override that does not parse (also python -m trainer.parity, for each side)."""
    lines = []
    for x in _chain(e):
        for line in str(x).splitlines():
            line = line.strip().rstrip(".")
            if line.startswith("Config search path"):
                break
            if line and line not in lines and not line.startswith(NOISE) and "$VALUE" not in line \
                    and line != "None" and not line.startswith("invalid literal"):
                lines.append(line)
    detail = "; ".join(lines).replace(":;", ":") or one_line(e)
    if getattr(e, "override", None):  # a parse error: name the override (a value with = or spaces needs quotes)
        detail = f"{e.override!r} does not parse ({detail}); quote a value that holds '=' or spaces: key='a=b'"
    return (f"the command line does not compose: {detail} (the keys are in trainer/config/schema.py; "
            f"`python trainer/main.py --cfg job` prints the whole config)")


@contextmanager
def user_errors():
    """A TesseraError (bad config, data, model, checkpoint, launch) exits with its code and message only.
    Rank 0 prints it; other ranks print it when it may differ from rank 0's, and one every rank meets from the
    same input (`same_on_every_rank`) only when rank 0 did not end the job first (exit_with).
    Known runtime faults raised inside torch.distributed (a peer gone, a collective timed out) or by the OS (disk
    full, read-only, permission denied) become one line naming the cause and the key or path, exit code 4.
    Anything else is a bug and keeps its traceback. TESSERA_DEBUG=1 prints the traceback of translated errors."""
    try:
        yield
    except TesseraError as e:
        exit_with(str(e), e.exit_code, e.same_on_every_rank)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - only the known fault classes are translated, the rest re-raised
        message = fault_message(e)
        if message is None:
            raise
        exit_with(message, EXIT_FAULT, same_on_every_rank=False)


def exit_with(message: str, code: int, same_on_every_rank: bool) -> None:
    """Print `error: <message>` (`[rank N] ` first in a job of several ranks) and exit with `code`. An error
    every rank reaches from the same input is printed once, by rank 0: another rank first waits for rank 0 to
    end the job (await_rank0) and prints it only if rank 0 did not."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0 and same_on_every_rank:
        await_rank0(code)
    debug_traceback()
    prefix = f"[rank {rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def await_rank0(code: int) -> None:
    """A rank other than 0 that met an error every rank meets: rank 0 prints it and exits with its code, and the
    launcher (torchrun's agent, DeepSpeed's launch.py) then stops this rank. Exiting first would instead make the
    launcher stop rank 0, perhaps before it printed anything. So: wait up to TESSERA_RANK0_WAIT_S seconds
    (default 10), a SIGTERM / SIGINT ending this process at once, silently, with `code`; returns when rank 0 did
    not end the job (it did not meet this error: another node's files, a launcher that does not stop the others)."""
    def stopped(*_):
        sys.stdout.flush()
        os._exit(code)  # nothing left to save or release: this rank never trained

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, stopped)
    time.sleep(float(os.environ.get("TESSERA_RANK0_WAIT_S", "10")))


def debug_traceback() -> None:
    """TESSERA_DEBUG=1: the traceback of the exception being handled, and of the one its message was made from
    (raised `from None`, which a plain traceback would hide)."""
    if os.environ.get("TESSERA_DEBUG", "") in ("", "0"):
        return
    import traceback

    e = sys.exc_info()[1]
    if e is not None and e.__suppress_context__ and e.__context__ is not None:
        traceback.print_exception(e.__context__)
    traceback.print_exc()


_DISK_ERRNOS = {"ENOSPC": "the disk is full", "EDQUOT": "the disk quota is exceeded",
                "EROFS": "the file system is read-only", "EACCES": "permission denied",
                "EPERM": "permission denied"}
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
              "remote process exited", "ncclremoteerror", "socket closed", "end of file", "peer closed",
              "communicator was aborted", "no route to host")
_TIMED_OUT = ("timed out", "timeout", "deadline exceeded")
_DIST_MARKERS = ("gloo", "nccl", "c10d", "processgroup", "tcpstore", "watchdog", "collective")


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def fault_message(e: BaseException):
    """One line for a known runtime fault (None for anything else): which peer or path, and what to change."""
    import errno as _errno

    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in {getattr(_errno, n) for n in _DISK_ERRNOS if hasattr(_errno, n)}:
            what = _DISK_ERRNOS[_errno.errorcode[x.errno]]
            path = x.filename or "a file of the run"
            return (f"{what}: {path} ({x.strerror}); free space or make it writable (the run directory is "
                    f"hydra.run.dir, the tokenization cache data.cache_dir / TESSERA_CACHE), then resume with "
                    f"checkpoint.resume=auto")
    text = " ".join(str(x) for x in _chain(e)).lower()
    if "no space left on device" in text:
        return ("the disk is full while writing (no space left on device); free space in hydra.run.dir (or the "
                "folder being written), then resume with checkpoint.resume=auto")
    dist_error = _is_dist_error(e)
    if not (dist_error or (isinstance(e, RuntimeError) and any(m in text for m in _DIST_MARKERS))):
        return None
    first = one_line(e)
    detail = first[first.rfind("] ") + 2:] if "] " in first else first  # past gloo's [file:line] prefixes
    detail = detail.split(". This is typically")[0][:200]
    watch = getattr(sys.modules.get("trainer.resilience.watchdog"), "active", lambda: None)()
    if any(p in text for p in _PEER_GONE):
        who = f" ({watch.who_stalled()})" if watch is not None else ""
        return f"{_peer()} is gone: the connection to it closed ({detail}){who}; it died or was killed, see its " \
               f"own output (or the launcher's) for why; resume with checkpoint.resume=auto"
    if any(p in text for p in _TIMED_OUT):
        timeout = getattr(sys.modules.get("trainer.parallel.dims"), "COLLECTIVE_TIMEOUT_S", None)
        limit = f"train.collective_timeout_s={timeout:g}" if timeout else "train.collective_timeout_s"
        who = (f"{watch.where()} (this rank); {watch.who_stalled()}" if watch is not None
               else f"{_peer()} stopped responding (stalled, stopped or much slower)")
        return (f"a collective timed out after {limit} seconds ({detail}) {who}; check it, or raise "
                f"train.collective_timeout_s if a step legitimately takes longer")
    if dist_error:
        return f"a communication fault between the ranks ({detail}); check the other ranks' output and the network"
    return None


def _is_dist_error(e) -> bool:
    dist = sys.modules.get("torch.distributed")
    classes = tuple(c for c in (getattr(dist, "DistError", None),) if isinstance(c, type))
    return bool(classes) and isinstance(e, classes)


def _peer() -> str:
    """The peer rank when it is unambiguous (two ranks), else 'a peer rank'."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    return f"rank {1 - rank}" if world == 2 and rank in (0, 1) else "a peer rank"
