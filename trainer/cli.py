"""What the entry point needs before Hydra sees the command line: launcher argv quirks, one run directory
for all ranks, and turning user errors into one message and a non-zero exit."""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

from omegaconf import OmegaConf

from trainer.errors import TesseraError


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
    return out


def launch_time(fmt: str = "%Y-%m-%d/%H-%M-%S") -> str:
    """When this run was launched: the start time of the launcher process (the parent of every local rank,
    so all ranks of a torchrun/deepspeed launch agree) or, for a plain `python` run, now."""
    ts = time.time()
    if "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        ts = _process_start_time(os.getppid()) or ts
    if "TESSERA_LAUNCH_TIME" in os.environ:  # set by launch.sh so that everything it starts agrees
        ts = float(os.environ["TESSERA_LAUNCH_TIME"])
    return time.strftime(fmt, time.localtime(ts))


def _process_start_time(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/stat") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("launch_time"):
        OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True)


@contextmanager
def user_errors():
    """A TesseraError (bad config, data, model, checkpoint, launch) exits non-zero with its message only.
    Rank 0 prints it; other ranks print it only when it may differ from rank 0's (not a config error)."""
    try:
        yield
    except TesseraError as e:
        rank = int(os.environ.get("RANK", "0"))
        from trainer.errors import ConfigError

        if rank == 0 or not isinstance(e, ConfigError):
            prefix = f"[rank {rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
            print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
