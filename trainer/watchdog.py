"""Stalled ranks: found within a bounded time, named, and the job ended so that it can restart.

Two things end a hang. A collective that waits longer than `train.collective_timeout_s` raises on the ranks that
wait (gloo and NCCL both honour the process group's timeout), and a progress watchdog ends a rank whose training
loop has not finished a step for max(train.collective_timeout_s, 3 x its slowest step so far) plus half the
collective timeout (so that a stall inside a collective is reported by the collective first), outside the phases
that are known to be long (evaluation, a checkpoint save, the export): a hang outside any collective, or one a
backend does not time out.

Either way the message names the stalled rank. Every rank beats: a daemon thread rewrites
`<run dir>/.heartbeat/rank-<r>.json` (its rank, pid, host, step, phase and a beat counter) about once a second and
at each step. The thread keeps beating while the main thread waits in a collective and stops only when the whole
process stops (SIGSTOP, a dead process, a machine gone), so the ranks whose counter does not move over a few beats
are the stalled ones. Nothing is half-written: beats go through a temporary file and an atomic rename, and a rank
that ends this way has no save in progress (the save phase is exempt; its collectives still time out, and a
checkpoint only counts once its completion marker is written).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Dict, List, Optional

FOLDER = ".heartbeat"
SLOW_STEP_FACTOR = 3.0

_ACTIVE: Optional["Watchdog"] = None


def active() -> Optional["Watchdog"]:
    """The watchdog of this process's run, if it has one (for the fault messages of trainer/cli.py)."""
    return _ACTIVE


def start(run_dir: str, rank: int, world_size: int, timeout_s: float):
    """The watchdog of a rank of a multi-process run; a lone process gets one that watches nothing."""
    return Watchdog(run_dir, rank, world_size, timeout_s) if world_size > 1 else Unwatched()


class Unwatched:
    step = 0

    def finished_step(self, step: int) -> None:
        self.step = step

    @contextmanager
    def exempt(self, phase: str):
        yield

    def close(self) -> None:
        pass


class Watchdog:
    def __init__(self, run_dir: str, rank: int, world_size: int, timeout_s: float,
                 interval_s: Optional[float] = None):
        self.folder = os.path.join(run_dir, FOLDER)
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.interval_s = interval_s or min(1.0, max(0.2, self.timeout_s / 20))
        self.step, self.phase = 0, "start-up"
        self.beats = 0
        self._armed = False  # from the first finished step on (start-up, the first compile are not timed)
        self._marked = time.monotonic()
        self._slowest = 0.0
        self._exempt = 0
        self._stop = threading.Event()
        self._wake = threading.Event()  # a new step: beat now, not at the next interval
        os.makedirs(self.folder, exist_ok=True)
        self._beat()
        self._thread = threading.Thread(target=self._run, name="tessera-watchdog", daemon=True)
        self._thread.start()
        global _ACTIVE
        _ACTIVE = self

    # -- the training loop's side --------------------------------------------------------------------------
    def finished_step(self, step: int) -> None:
        now = time.monotonic()
        if self._armed and self._exempt == 0:
            self._slowest = max(self._slowest, now - self._marked)
        self.step, self.phase, self._marked, self._armed = step, "step", now, True
        self._wake.set()

    @contextmanager
    def exempt(self, phase: str):
        """A phase that may legitimately take long (evaluation, a save, the export): not timed."""
        self._exempt += 1
        before, self.phase = self.phase, phase
        self._wake.set()
        try:
            yield
        finally:
            self._exempt -= 1
            self.phase, self._marked = before, time.monotonic()
            self._wake.set()

    def limit_s(self) -> float:
        """Half the collective timeout more than the longer of it and 3x the slowest step: a stall inside a
        collective is reported by the collective's own timeout first (it knows what it waited for)."""
        return max(self.timeout_s, SLOW_STEP_FACTOR * self._slowest) + 0.5 * self.timeout_s

    def close(self) -> None:
        """Stop beating. It still answers `who_stalled` (a failed run is closed before its error is reported)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    # -- the thread -----------------------------------------------------------------------------------------
    def _path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank-{rank}.json")

    def _beat(self) -> None:
        self.beats += 1
        body = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "step": self.step,
                "phase": self.phase, "beat": self.beats}
        tmp = self._path(self.rank) + ".tmp"
        try:
            with open(tmp, "w") as fh:
                json.dump(body, fh)
            os.replace(tmp, self._path(self.rank))
        except OSError:
            pass  # a full disk is reported by what the run writes; the beat is only a hint

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            self._beat()
            if self._armed and self._exempt == 0 and time.monotonic() - self._marked > self.limit_s():
                self._fire()

    def _fire(self) -> None:
        from tessera.errors import EXIT_FAULT

        waited = time.monotonic() - self._marked
        print(f"[rank {self.rank}] error: no progress for {waited:.0f} s after step {self.step} (limit "
              f"{self.limit_s():.0f} s from train.collective_timeout_s={self.timeout_s:g} and the slowest step); "
              f"{self.who_stalled()}; stopping (exit code 4)", file=sys.stderr, flush=True)
        os._exit(EXIT_FAULT)

    # -- who stalled ----------------------------------------------------------------------------------------
    def _read(self) -> Dict[int, dict]:
        seen = {}
        for rank in range(self.world_size):
            try:
                with open(self._path(rank)) as fh:
                    seen[rank] = json.load(fh)
            except (OSError, ValueError):
                pass
        return seen

    def stalled(self, window_s: Optional[float] = None) -> List[dict]:
        """The ranks whose beat did not move over `window_s` (default 3 beats): their last beat (or {"rank": r}
        for one that never beat)."""
        first = self._read()
        time.sleep(window_s if window_s is not None else 3 * self.interval_s)
        second = self._read()
        out = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            a, b = first.get(rank), second.get(rank)
            if b is None or (a is not None and a.get("beat") == b.get("beat") and a.get("pid") == b.get("pid")):
                out.append(b or {"rank": rank})
        return out

    def who_stalled(self) -> str:
        """One phrase naming the stalled ranks and their step, for an error message."""
        self._exempt += 1  # this rank is already reporting: its own watchdog does not fire as well
        stalled = self.stalled()
        if not stalled:
            return f"every other rank is still alive (this rank was at step {self.step}, {self.phase})"
        names = []
        for s in stalled:
            if "pid" not in s:
                names.append(f"rank {s['rank']} (it never started beating)")
                continue
            where = f"during step {s['step'] + 1}" if s["phase"] == "step" else f"at step {s['step']} ({s['phase']})"
            names.append(f"rank {s['rank']} (pid {s['pid']} on {s['host']}) {where}")
        return f"stalled: {', '.join(names)}, no heartbeat for {3 * self.interval_s:.0f} s"
