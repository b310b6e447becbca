"""The `deepspeed` launcher for launch.sh, with Tessera's exits.

    python -m trainer.launch.deepspeed [deepspeed runner arguments] trainer/main.py [overrides]

DeepSpeed's runner starts deepspeed.launcher.launch, which starts the ranks. Alone, a SIGTERM to the runner
ends the runner only (the ranks keep training, orphaned), and Ctrl-C ends every process with tracebacks and
exit 1. Here the runner runs in a session of its own (a terminal's Ctrl-C reaches this process only), and
SIGTERM / SIGINT are forwarded to the ranks, which stop after the same step and save; DeepSpeed's launchers
then see every rank exit 0 and so does this one, without a traceback. The ranks know this process as their
launcher (TESSERA_LAUNCHER_PID): if it dies, even by SIGKILL, they stop and save (trainer/resilience/preemption.py), and
the runner ends with them. The ranks get TESSERA_STOP_GRACE_S seconds (default 600) to save, then are killed
(exit 4). A launch that failed on a fault is started again, up to TESSERA_MAX_RESTARTS times (train.max_restarts,
set by launch.sh); the ranks continue the run from its newest complete checkpoint (trainer/launch/restarts.py).

Before anything starts: a stale build lock of a DeepSpeed op this machine needs is an error (exit 2, naming the
lock), and an op that still has to be built is built here, with progress (trainer/launch/ds_ops.py).
"""
from __future__ import annotations

import os
import subprocess
import sys

from trainer.launch.torchrun import Forwarder, children, outcome_after_stop
from trainer.launch import ds_ops, restarts

LAUNCH_MODULE = "deepspeed.launcher.launch"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def ranks_of(runner_pid: int) -> list:
    """The ranks: children of DeepSpeed's launch.py under the runner."""
    ranks, frontier = [], [runner_pid]
    for _ in range(4):  # runner -> launch.py -> ranks (a wrapper or two in between at most)
        nxt = []
        for pid in frontier:
            for child in children(pid):
                if LAUNCH_MODULE in _cmdline(pid):
                    ranks.append(child)
                else:
                    nxt.append(child)
        if ranks or not nxt:
            break
        frontier = nxt
    return ranks


def prepare_ops() -> int:
    """Exit code 2 for a stale build lock; build a missing op with progress. 0 when ready (or not needed)."""

    return ds_ops.main(["build"])


def main(argv) -> int:

    code = prepare_ops()
    if code:
        return code
    runner = None

    def find_ranks():
        if runner is None:
            return []
        ranks = ranks_of(runner.pid)
        return ranks if ranks else [runner.pid]  # before the ranks exist: the runner (it has no handler: it ends)

    stop = Forwarder(find_ranks)
    stop.install()

    def attempt() -> int:
        nonlocal runner
        env = dict(os.environ, TESSERA_LAUNCHER_PID=str(os.getpid()))
        runner = subprocess.Popen([sys.executable, "-u", "-m", "deepspeed.launcher.runner", *argv], env=env,
                                  start_new_session=True)
        return outcome_after_stop(runner.wait(), stop)

    try:
        return restarts.supervise(attempt, lambda: stop.signum is not None, stop.label)
    finally:
        stop.cancel()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
