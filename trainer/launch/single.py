"""launch.sh's launcher for one process (strategy=single), with the restarts of the others.

    python -m trainer.launch.single trainer/main.py [overrides]

The trainer runs as a child in a session of its own; SIGTERM / SIGINT (Ctrl-C) are forwarded to it once, and it
stops after the step with a checkpoint (exit 0). If the trainer dies on a fault (killed by a signal, exit 4, a
crash), it is started again, up to TESSERA_MAX_RESTARTS times (train.max_restarts, set by launch.sh), and
continues the run from its newest complete checkpoint (trainer/launch/restarts.py). The trainer knows this process as
its launcher (TESSERA_LAUNCHER_PID): if this process dies, even by SIGKILL, the trainer stops and saves.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from trainer.launch.torchrun import Forwarder, outcome_after_stop
from trainer.launch import restarts


def main(argv) -> int:

    child = None
    stop = Forwarder(lambda: [child.pid] if child is not None and child.poll() is None else [])
    stop.install()

    def attempt() -> int:
        nonlocal child
        env = dict(os.environ, TESSERA_LAUNCHER_PID=str(os.getpid()))
        child = subprocess.Popen([sys.executable, *argv], env=env, start_new_session=True)
        code = child.wait()
        if code < 0 and stop.signum is None:  # killed by a signal: it could not say anything itself
            print(f"{stop.label}: error: the trainer (pid {child.pid}) was killed by {signal.Signals(-code).name}",
                  file=sys.stderr, flush=True)
        return outcome_after_stop(code, stop)

    try:
        return restarts.supervise(attempt, lambda: stop.signum is not None, stop.label)
    finally:
        stop.cancel()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
