"""launch.sh's launcher for torchft replica groups on one machine (strategy.fault_tolerance=torchft with
strategy.replica_group=-1): a torchft lighthouse, unless strategy.lighthouse or $TORCHFT_LIGHTHOUSE names one,
and `strategy.replica_groups` torchrun jobs of --nproc_per_node ranks each (trainer/launch/torchrun.py, so each group
has its own restarts: a group that fails is started again and recovers from a live one while the others train
on). SIGTERM / Ctrl-C reach every group, which stop and save. The exit code is the first failing group's, else 0.

    python -m trainer.launch.torchft --nproc_per_node 2 trainer/main.py strategy.fault_tolerance=torchft ...

On several machines, start one lighthouse (`torchft_lighthouse --min_replicas 1`) and one torchrun job per
group with strategy.replica_group=<g> and strategy.lighthouse=http://<host>:29510 (docs/fault-tolerance.md).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from tessera import import_time
from trainer.launch.torchrun import STOP_SIGNALS

LABEL = "launch.sh"


def lighthouse_command(min_replicas: int, port: int) -> list:
    """torchft's lighthouse binary: quorums of at least `min_replicas` groups. A group that stops heartbeating
    for 5 s is out of the next quorum; a group that heartbeats but is not yet asking for a quorum (starting up)
    is waited for up to 5 s, so groups started together begin together."""
    binary = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return [binary, "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}", "--join_timeout_ms", "5000",
            "--heartbeat_timeout_ms", "5000"]


def _reachable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def start_lighthouse(min_replicas: int):
    """A lighthouse on a free local port -> (process, address); an error exit when it does not come up."""
    from trainer.parallel.dims import free_port  # torch: only once a lighthouse starts

    port = free_port()
    proc = subprocess.Popen(lighthouse_command(min_replicas, port), env=dict(os.environ, RUST_LOG="warn"),
                            stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while not _reachable(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            print(f"{LABEL}: error: the torchft lighthouse did not start (exit {proc.poll()}); is torchft "
                  f"installed in this environment?", file=sys.stderr)
            sys.exit(1)
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}"


def main(argv) -> int:
    with import_time.imports_frozen():  # tessera/import_time.py
        # hydra and torch: only for a launch, not for this module's constants
        from trainer.launch.choose import compose
        from trainer.parallel.replica_groups import LIGHTHOUSE_ENV, lighthouse_address

    nproc_flag, nproc, script, overrides = argv[0], argv[1], argv[2], argv[3:]
    if nproc_flag != "--nproc_per_node":
        raise SystemExit("usage: python -m trainer.launch.torchft --nproc_per_node N trainer/main.py [overrides]")
    cfg = compose(overrides)
    s = cfg.strategy
    env = dict(os.environ)
    lighthouse = None
    if not lighthouse_address(s):
        lighthouse, env[LIGHTHOUSE_ENV] = start_lighthouse(s.min_replica_groups)
        print(f"{LABEL}: torchft lighthouse at {env[LIGHTHOUSE_ENV]}; {s.replica_groups} replica groups of {nproc} "
              f"ranks", file=sys.stderr, flush=True)
    groups = [subprocess.Popen([sys.executable, "-m", "trainer.torchrun", "--standalone", "--nproc_per_node",
                                str(nproc), script, *overrides, f"strategy.replica_group={g}"], env=env)
              for g in range(s.replica_groups)]

    def forward(signum, frame):
        for proc in groups:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    try:
        codes = [proc.wait() for proc in groups]
    finally:
        if lighthouse is not None:
            lighthouse.terminate()
            lighthouse.wait()
    failed = [(g, c) for g, c in enumerate(codes) if c != 0]
    for g, c in failed:
        print(f"{LABEL}: replica group {g} exited with code {c}", file=sys.stderr)
    return failed[0][1] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
