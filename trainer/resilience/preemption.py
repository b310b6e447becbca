"""SIGTERM / SIGINT during training: finish the step, save a checkpoint, exit cleanly.

The signal only sets a flag; at each step boundary the ranks agree (a one-element all-reduce) so that all of
them stop after the same step, even when the signal reached them at different moments. A second Ctrl-C
interrupts at once. The flag travels on the CPU (a gloo group of its own where the default group is NCCL): reading
a flag that sat on the GPU would wait for the whole step's kernels every step, and the host could no longer queue
the next step's work while the GPU is busy.

No rank outlives its launcher (`guard_launcher`, armed when this module is imported by a rank a launcher started):
the rank asks the kernel for SIGTERM when its parent dies (Linux PR_SET_PDEATHSIG: torchrun's agent, DeepSpeed's
launch.py), and a daemon thread watches the launchers further up (the `deepspeed` runner, torchrun, Tessera's
wrappers, $TESSERA_LAUNCHER_PID) once a second and sends this process SIGTERM when one is gone. Either way the
ranks then stop after the same step and save, as for any SIGTERM; before training starts SIGTERM simply ends the
process. A rank that still runs TESSERA_STOP_GRACE_S seconds (default 600) after its launcher vanished exits
with code 4.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist


class StopRequest:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = None
        self.reason = ""  # a stop the run asked for itself (train.max_time_s)
        self._previous = {}
        self.group = None  # collective: every rank constructs its StopRequest at the same point
        if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def name(self) -> str:
        if self.reason:
            return self.reason
        return signal.Signals(self.signum).name if self.signum else ""

    def request(self, reason: str) -> None:
        """Stop for `reason` (a limit of the run, not a signal); agreed by all ranks like a signal."""
        self.reason = reason

    def agreed(self) -> bool:
        """True on every rank once any rank got a stop signal (collective: every rank calls it each step)."""
        local = self.signum is not None or bool(self.reason)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local
        # 2: a rank's own limit (request), 1: a signal; a rank that has neither stops for the highest
        flag = torch.tensor([2 if self.reason else 1 if local else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        seen = int(flag.item())
        if seen == 2 and not local:
            self.reason = "another rank's limit (train.max_time_s)"
        elif seen and not local:
            self.signum = signal.SIGTERM
        return bool(seen)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


# ---------------------------------------------------------------------------------------------------------------
# No orphans: a rank stops when its launcher is gone.

# Launchers, recognised by their command line: a module run with -m, or a console script's name.
LAUNCHER_MODULES = ("deepspeed.launcher.launch", "deepspeed.launcher.runner", "torch.distributed.run",
                    "torch.distributed.launch", "trainer.torchrun", "trainer.launch.torchrun", "trainer.launch.deepspeed",
                    "trainer.launch.deepspeed_runner")
LAUNCHER_SCRIPTS = ("torchrun", "deepspeed")
_PR_SET_PDEATHSIG = 1
_guard_started = False


def guard_started() -> bool:
    """Whether this process watches its launcher chain (armed on import in a launched rank)."""
    return _guard_started


def proc_stat(pid: int):
    """(parent pid, start time in clock ticks) of a live process, or None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def is_launcher(args) -> bool:
    """True for the command line of a launcher: `python -m <launcher module>`, `torchrun ...`, `deepspeed ...`
    (the console script run directly or by its interpreter)."""
    if any(m in args for m in LAUNCHER_MODULES):
        return True
    return any(os.path.basename(a) in LAUNCHER_SCRIPTS for a in args[:2])


def launcher_chain(pid: int = None) -> list:
    """[(pid, start time)] of the launchers among the ancestors of `pid` (this process by default), plus
    $TESSERA_LAUNCHER_PID: the processes whose end must end this rank."""
    chain, seen = [], set()
    pid = os.getpid() if pid is None else pid
    stat = proc_stat(pid)
    while stat is not None and stat[0] > 1 and stat[0] not in seen:
        parent = stat[0]
        seen.add(parent)
        stat = proc_stat(parent)
        if stat is not None and is_launcher(_cmdline(parent)):
            chain.append((parent, stat[1]))
    extra = os.environ.get("TESSERA_LAUNCHER_PID", "")
    if extra.isdigit() and int(extra) not in seen and int(extra) != os.getpid():
        st = proc_stat(int(extra))
        if st is not None:
            chain.append((int(extra), st[1]))
    return chain


def _set_parent_death_signal(sig: int) -> bool:
    """PR_SET_PDEATHSIG: the kernel sends `sig` to this process when the thread that started it ends."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(chain, interval: float, grace: float) -> None:
    while True:
        gone = [pid for pid, start in chain if (proc_stat(pid) or (None, None))[1] != start]
        if gone:
            break
        time.sleep(interval)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"warning: the launcher (pid {gone[0]}) is gone: this rank stops (and saves if training)",
              file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the StopRequest handler sets the flag; before it, SIGTERM ends us
    time.sleep(grace)
    print(f"error: still running {grace:.0f} s after the launcher (pid {gone[0]}) was gone: exiting (code 4); "
          f"raise TESSERA_STOP_GRACE_S for longer saves", file=sys.stderr, flush=True)
    os._exit(4)


def guard_launcher(interval: float = 1.0) -> bool:
    """Arm the launcher guards once per process (see the module docstring). Returns True when a watcher runs."""
    global _guard_started
    if _guard_started or not sys.platform.startswith("linux") or not os.path.isdir("/proc"):
        return False
    _guard_started = True
    parent = os.getppid()
    _set_parent_death_signal(signal.SIGTERM)
    chain = launcher_chain()
    if os.getppid() != parent:  # the parent died before the guard was armed
        os.kill(os.getpid(), signal.SIGTERM)
    if not chain:
        return False
    grace = float(os.environ.get("TESSERA_STOP_GRACE_S", "600"))
    threading.Thread(target=_watch, args=(chain, interval, grace), name="tessera-launcher-guard",
                     daemon=True).start()
    return True


def _started_by_a_launcher() -> bool:
    return "LOCAL_RANK" in os.environ or os.environ.get("TESSERA_LAUNCHER_PID", "").isdigit()


if _started_by_a_launcher():  # a rank: armed as early as its first import of the trainer
    guard_launcher()
