"""Launch one side of a parity check in its own run directory, with the launcher launch.sh would use
(trainer/launch/choose.py), and read back its metrics; a side that fails ends the check with its exit code."""
from __future__ import annotations

import json
import os
import sys
from typing import List

from tessera.errors import EXIT_FAULT, FaultError, TesseraError, one_line
from trainer.launch.choose import launcher_command, run_process_group
from trainer.observe.parity.sides import Side

# launch.sh's torchrun: one-line failures and the failing rank's exit code (the bare torchrun exits 1 for any)
RUNNERS = {"python": "python", "torchrun": "torchrun-quiet", "deepspeed": "deepspeed"}
TAIL_LINES = 12


class SideFailed(TesseraError):
    """A side's run ended with an error: the parity check ends with the same exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def error_tail(text: str, lines: int = TAIL_LINES) -> List[str]:
    """The lines that matter of a failed run's output: from its first `error:` line on (the one-line messages of
    tessera/errors.py, and the problem list a configuration error prints under it), else the last non-empty lines
    (a traceback's end)."""
    kept = [line for line in text.splitlines() if line.strip()]
    first = next((i for i, line in enumerate(kept) if "error:" in line), None)
    return kept[-lines:] if first is None else kept[first:first + lines]


def run_side(side: Side, run_dir: str, timeout: float) -> list:
    """Run the side into `run_dir` and return its metrics.jsonl records. Its output goes to `run_dir`/launch.log."""
    cmd = launcher_command(RUNNERS[side.launcher], side.nproc) + side.argv(run_dir)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    print(f"side {side.label}: {side.describe()} -> {run_dir}", flush=True)
    try:
        proc = run_process_group(cmd, env=env, timeout=timeout)
    except AssertionError:  # run_process_group's timeout: every process of the side is already killed
        raise FaultError(f"side {side.label} did not finish within --timeout {timeout:g} s (a hang?); its "
                         f"processes were stopped") from None
    _write_log(run_dir, cmd, proc)
    if proc.returncode != 0:
        code = proc.returncode if proc.returncode > 0 else EXIT_FAULT  # killed by a signal: a fault
        tail = "\n".join(f"  {line}" for line in error_tail(proc.stderr + "\n" + proc.stdout))
        raise SideFailed(f"side {side.label} ({side.describe()}) failed with exit code {proc.returncode}; its last "
                         f"error lines (all of it: {os.path.join(run_dir, 'launch.log')}):\n{tail}", code)
    print(f"side {side.label}: done in {proc.seconds:.1f} s", flush=True)
    return read_metrics(run_dir, side)


def _write_log(run_dir: str, cmd, proc) -> None:
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "launch.log"), "w") as fh:
            fh.write(" ".join(cmd) + "\n\n--- stdout\n" + proc.stdout + "\n--- stderr\n" + proc.stderr)
    except OSError as e:  # the log is a convenience: the check goes on without it
        print(f"warning: launch.log of {run_dir} not written: {one_line(e)}", file=sys.stderr)


def read_metrics(run_dir: str, side: Side) -> list:
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path) as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except (OSError, ValueError) as e:
        raise FaultError(f"side {side.label} finished but its {path} cannot be read: {one_line(e)}") from None
