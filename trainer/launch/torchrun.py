"""torchrun for launch.sh: the same launcher, with Tessera's exits.

- A rank that fails ends with its own message and exit code instead of torchrun's traceback of the failure (the
  rank already printed what went wrong).
- SIGTERM / SIGINT (Ctrl-C) is forwarded to the ranks, which stop after the same step and save; the launcher then
  exits 0 without a traceback (torchrun alone would raise SignalException: exit 1 and a traceback, and SIGKILL
  its workers after TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s). torchrun keeps SIGHUP and SIGQUIT. The ranks get
  TESSERA_STOP_GRACE_S seconds (default 600) to save; after that they are killed and the launcher exits 4.
- A launch that failed on a fault is started again, up to TESSERA_MAX_RESTARTS times (train.max_restarts, set by
  launch.sh), and the ranks continue the run from its newest complete checkpoint (trainer/launch/restarts.py).
- The ranks know this process as their launcher (TESSERA_LAUNCHER_PID); if it dies, even by SIGKILL, they stop
  and save (trainer/resilience/preemption.py: guard_launcher).
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from tessera import import_time
from tessera.errors import EXIT_FAULT, EXIT_INTERRUPTED
from trainer.launch import restarts

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"  # torchrun's own handling (SignalException) stays for these only


def stop_grace_s() -> float:
    return float(os.environ.get("TESSERA_STOP_GRACE_S", "600"))


def children(pid: int) -> list:
    """Live child processes of `pid` (/proc; empty elsewhere)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


def signal_pids(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


class Forwarder:
    """SIGTERM/SIGINT handler of a launcher: forwards each one to the ranks `find_ranks()` returns; the first one
    arms a timer that kills the ranks (and `on_escalate`) when they have not ended after the grace period."""

    def __init__(self, find_ranks, label: str = "launch.sh"):
        self.find_ranks = find_ranks
        self.label = label
        self.signum = None
        self.count = 0
        self.escalated = False
        self._timer = None

    def install(self) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, self.handle)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def handle(self, signum, frame) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
            self._timer = threading.Timer(stop_grace_s(), self.escalate)
            self._timer.daemon = True
            self._timer.start()
        signal_pids(self.find_ranks(), signum)

    def escalate(self) -> None:
        self.escalated = True
        print(f"{self.label}: the ranks did not stop within {stop_grace_s():.0f} s of {self.name}; killing them "
              f"(set TESSERA_STOP_GRACE_S for longer saves)", file=sys.stderr, flush=True)
        signal_pids(self.find_ranks(), signal.SIGKILL)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def outcome_after_stop(code: int, stop: Forwarder) -> int:
    """The exit code of a launch whose ranks ended with `code`, after a stop signal the Forwarder passed on (or
    not: then `code` as it is)."""

    if stop.signum is None:
        return code
    if stop.escalated:
        return EXIT_FAULT
    if code == 0:
        return 0
    if code == EXIT_INTERRUPTED:
        print(f"{stop.label}: interrupted twice: the ranks stopped at once, without saving", file=sys.stderr)
        return EXIT_INTERRUPTED
    if code < 0 or code in (128 + stop.signum, 256 - stop.signum):  # ended by the signal before training
        print(f"{stop.label}: stopped by {stop.name} before training started (nothing to save)", file=sys.stderr)
        return 0
    print(f"{stop.label}: the ranks ended with exit code {code} after {stop.name}", file=sys.stderr)
    return code


def _with_default_signals(argv):
    if any(a.split("=")[0] in ("--signals-to-handle", "--signals_to_handle") for a in argv):
        return list(argv)
    return ["--signals-to-handle", TORCHRUN_SIGNALS] + list(argv)


def main(argv) -> int:
    with import_time.imports_frozen():  # torch's agent: tessera/import_time.py
        from torch.distributed.run import parse_args

    args = parse_args(_with_default_signals(argv))
    os.environ["TESSERA_LAUNCHER_PID"] = str(os.getpid())  # the ranks inherit it: they watch this process
    # After a rank failed, the others get this long to end before they are killed (a SIGSTOPped rank never ends
    # by itself). A user's SIGTERM/SIGINT does not go through it: the Forwarder gives the ranks their stop grace.
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    if ":" in str(args.nnodes):
        # Elastic membership: torch (2.13) caches the address of the rendezvous store it shares with the ranks on
        # the agent that stays rank 0, so a node that joins in a later round waits forever for that address;
        # without the sharing every round publishes its own.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    me = os.getpid()
    stop = Forwarder(lambda: children(me))  # torchrun's agent runs in this process: the ranks are its children
    stop.install()
    try:
        return restarts.supervise(lambda: _attempt(args, stop), lambda: stop.signum is not None, stop.label)
    finally:
        stop.cancel()


def kill_stopped_ranks(me: int, done: threading.Event, poll: float = 0.5) -> None:
    """Once a rank has ended while another is stopped (SIGSTOP, a frozen node, a debugger), SIGKILL the stopped one:
    the job is over, a stopped process cannot save, and a continued one would only add a second error message
    (its peers are gone) before the agent's shutdown timeout."""
    seen = set()
    while not done.wait(poll):
        states = {pid: _state(pid) for pid in children(me)}
        seen |= set(states)
        ended = any(pid not in states for pid in seen)
        stopped = [pid for pid, state in states.items() if state in ("T", "t")]
        if ended and stopped:
            signal_pids(stopped, signal.SIGKILL)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _attempt(args, stop: Forwarder) -> int:
    """One launch of the ranks by torchrun's agent -> the launch's exit code, failures said in one line."""
    done = threading.Event()
    threading.Thread(target=kill_stopped_ranks, args=(os.getpid(), done), daemon=True).start()
    try:
        return _attempt_once(args, stop)
    finally:
        done.set()


def _attempt_once(args, stop: Forwarder) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(args)
    except RuntimeError as e:  # the agent's own rendezvous store could not bind --master_port
        from trainer.parallel.dims import port_in_use_message  # torch's: only on this failure

        text = str(e).lower()
        if "eaddrinuse" not in text and "address already in use" not in text:
            raise
        print(f"{stop.label}: error: {port_in_use_message(args.master_port, args.master_addr)}", file=sys.stderr)
        return 2
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if stop.escalated:
            return EXIT_FAULT
        if stop.signum is not None:
            if code == EXIT_INTERRUPTED:
                print(f"{stop.label}: interrupted twice: the ranks stopped at once, without saving",
                      file=sys.stderr)
                return EXIT_INTERRUPTED
            if code is not None and code < 0 and -code in (stop.signum, signal.SIGTERM, signal.SIGINT):
                print(f"{stop.label}: stopped by {stop.name} before training started (nothing to save)",
                      file=sys.stderr)
                return 0
        if code is not None and code < 0:  # killed by a signal: it could not report anything itself
            print(f"{stop.label}: error: rank {rank} was killed by {signal.Signals(-code).name}; the other ranks "
                  f"were stopped", file=sys.stderr)
            return EXIT_FAULT
        print(f"{stop.label}: rank {rank} exited with code {code}; the other ranks were stopped",
              file=sys.stderr)
        return code if code and code > 0 else 1
    except SignalException as e:  # a signal torchrun handles itself (SIGHUP, SIGQUIT, or a user's list)
        print(f"{stop.label}: stopped by {signal.Signals(e.sigval).name}; the ranks were asked to stop",
              file=sys.stderr)
        stop.signum = stop.signum or e.sigval  # a stop: not restarted
        return 0 if e.sigval in STOP_SIGNALS else 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
