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
import tempfile
from typing import List

from tessera import import_time

from trainer.launch.torchrun import Forwarder, children, outcome_after_stop
from trainer.launch import ds_ops, restarts

LAUNCH_MODULE = "deepspeed.launcher.launch"
RUNNER_MODULE = "trainer.launch.deepspeed_runner"  # DeepSpeed's runner, imported without mlflow


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


def _option(argv: List[str], name: str):
    """The value of `--name V` or `--name=V` among the runner's own arguments (before the script), else None."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py"):
            break
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def with_node_hostfile(argv: List[str], folder: str) -> List[str]:
    """launch.sh's several nodes without a hostfile (NNODES=N: `--num_nodes N --node_rank R --no_ssh` on every
    node): DeepSpeed's runner knows other nodes only from a hostfile, even when each node starts its own launcher,
    so one is written with N nodes of --num_gpus slots each. Its names are labels only (no ssh; the master is
    --master_addr)."""
    nodes = int(_option(argv, "--num_nodes") or 1)
    if nodes <= 1 or "--no_ssh" not in argv or _option(argv, "--hostfile") is not None:
        return argv
    slots = int(_option(argv, "--num_gpus") or 1)
    path = os.path.join(folder, "hostfile")
    with open(path, "w") as fh:
        fh.writelines(f"node{i} slots={slots}\n" for i in range(nodes))
    return ["--hostfile", path, *argv]


def main(argv) -> int:
    with import_time.imports_frozen():  # torch and DeepSpeed's op builder: tessera/import_time.py
        code = prepare_ops()
    if code:
        return code
    with tempfile.TemporaryDirectory(prefix="tessera-ds-") as folder:
        return _launch(with_node_hostfile(list(argv), folder))


def _launch(argv) -> int:
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
        runner = subprocess.Popen([sys.executable, "-u", "-m", RUNNER_MODULE, *argv], env=env,
                                  start_new_session=True)
        return outcome_after_stop(runner.wait(), stop)

    try:
        return restarts.supervise(attempt, lambda: stop.signum is not None, stop.label)
    finally:
        stop.cancel()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
