"""Stalled ranks: found within a bounded time, named, and the job ended so that it can restart.

Two things end a hang. A collective that waits longer than `train.collective_timeout_s` raises on the ranks that
wait (gloo and NCCL both honour the process group's timeout), and a progress watchdog ends a rank whose training
loop has not finished a step for max(train.collective_timeout_s, 3 x its slowest step so far) plus half the
collective timeout (so that a stall inside a collective is reported by the collective first), outside the phases
that are known to be long (evaluation, a checkpoint save, the export): a hang outside any collective, or one a
backend does not time out.

A peer that goes silent is caught in every phase, the long ones included (a save, an evaluation, the export, a
resume check): once a peer's heartbeat has not moved for 1.5 x train.collective_timeout_s, the rank that sees it
ends with one message naming its own phase and the silent rank (exit 4, so a launcher with restarts left starts
the ranks again). A collective that involves the silent rank times out first where the backend honours timeouts
(every group Tessera, DCP, DeviceMesh or DeepSpeed creates inherits train.collective_timeout_s: trainer/parallel/dims.py);
the heartbeat catches the rest (work outside any collective, a backend that does not time out). When the silent
peer runs on this host and its launcher is gone (the launcher was killed, so nothing would ever end it), the rank
that reports it SIGKILLs it first: a stopped (SIGSTOP) or hung process outlives any Python signal handler.

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
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Dict, List, Optional

from tessera.errors import EXIT_FAULT

FOLDER = ".heartbeat"
SLOW_STEP_FACTOR = 3.0
SILENT_PEER_FACTOR = 1.5  # x train.collective_timeout_s: a collective involving the peer times out first
ALL_PEERS_UP_TO = 64  # larger worlds: each rank watches its two neighbours on the ring (N reads, not N^2)
ENDED = "ended"  # the phase of a rank that closed its watchdog at the end of a run: not silent, finished

_ACTIVE: Optional["Watchdog"] = None


def active() -> Optional["Watchdog"]:
    """The watchdog of this process's run, if it has one (for the fault messages of trainer/run/cli.py)."""
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

    def close(self, ended: bool = False) -> None:
        pass


class Watchdog:
    def __init__(self, run_dir: str, rank: int, world_size: int, timeout_s: float,
                 interval_s: Optional[float] = None):
        self.folder = os.path.join(run_dir, FOLDER)
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.interval_s = interval_s or min(1.0, max(0.2, self.timeout_s / 20))
        self.step, self.phase = 0, "start-up"
        self.failed_in = None  # (phase, step) an exception left an exempt phase from
        self._beat_lock = threading.Lock()  # the thread beats, and so does the main thread entering a phase
        self.beats = 0
        self._armed = False  # from the first finished step on (start-up, the first compile are not timed)
        self._marked = time.monotonic()
        self._slowest = 0.0
        self._exempt = 0
        self._stop = threading.Event()
        self._wake = threading.Event()  # a new step: beat now, not at the next interval
        self._launcher = os.getppid()  # a peer whose parent is no longer this pid was orphaned (reap_orphan)
        self._peers = peers_of(rank, world_size)
        self._peer_seen: Dict[int, tuple] = {}  # rank -> ((pid, beat) last read, monotonic time it last moved)
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
        """A phase that may legitimately take long (evaluation, a save, the export): not timed. Its beat is written
        now, not by the thread: a rank that freezes in the phase's first instant is still seen in it."""
        self._exempt += 1
        before, self.phase = self.phase, phase
        self._beat()
        try:
            yield
        except BaseException:
            self.failed_in = self.failed_in or (phase, self.step)  # the message is made after the phase is left
            raise
        finally:
            self._exempt -= 1
            self.phase, self._marked = before, time.monotonic()
            self._wake.set()

    def where(self) -> str:
        """This rank's place, for a message: 'during step 9', 'in the evaluation after step 8'."""
        phase, step = self.failed_in or (self.phase, self.step)
        if phase == "step":
            return f"during step {step + 1}"
        return f"in the {phase} after step {step}" if step else f"in the {phase}"

    def limit_s(self) -> float:
        """Half the collective timeout more than the longer of it and 3x the slowest step: a stall inside a
        collective is reported by the collective's own timeout first (it knows what it waited for)."""
        return max(self.timeout_s, SLOW_STEP_FACTOR * self._slowest) + 0.5 * self.timeout_s

    def close(self, ended: bool = False) -> None:
        """Stop beating. It still answers `who_stalled` (a failed run is closed before its error is reported).
        `ended`: the run finished here; a last beat says so, and peers still working do not take this rank's
        silence for a fault."""
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        if ended:
            self.phase = ENDED
            self._beat()

    # -- the thread -----------------------------------------------------------------------------------------
    def _path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank-{rank}.json")

    def _beat(self) -> None:
        with self._beat_lock:
            self._write_beat()

    def _write_beat(self) -> None:
        self.beats += 1
        body = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "step": self.step,
                "phase": self.phase, "beat": self.beats, "launcher": self._launcher}
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
            if not self._armed:
                continue
            if self._exempt == 0 and time.monotonic() - self._marked > self.limit_s():
                self._fire()
            silent = self.silent_peers()
            if silent:
                self._fire_silent(silent)

    def _fire(self) -> None:
        waited = time.monotonic() - self._marked
        print(f"[rank {self.rank}] error: no progress for {waited:.0f} s after step {self.step} (limit "
              f"{self.limit_s():.0f} s from train.collective_timeout_s={self.timeout_s:g} and the slowest step); "
              f"{self.who_stalled()}; stopping (exit code 4)", file=sys.stderr, flush=True)
        os._exit(EXIT_FAULT)

    def peer_limit_s(self) -> float:
        return SILENT_PEER_FACTOR * self.timeout_s

    def silent_peers(self) -> List[dict]:
        """The watched peers whose heartbeat has not moved for peer_limit_s (their last beat), in any phase.
        A peer is timed from the first beat of it this rank read; one that ended its run is not silent."""
        now = time.monotonic()
        for rank, beat in self._read(self._peers).items():
            key = (beat.get("pid"), beat.get("beat"))
            last = self._peer_seen.get(rank)
            if last is None or last[0] != key:
                self._peer_seen[rank] = (key, now, beat)
        return [beat for key, since, beat in self._peer_seen.values()
                if beat.get("phase") != ENDED and now - since > self.peer_limit_s()]

    def _fire_silent(self, silent: List[dict]) -> None:
        self._exempt += 1  # reporting now: the progress check does not fire as well
        names = ", ".join(_describe(b) for b in silent)
        print(f"[rank {self.rank}] error: {names} has not answered for more than {self.peer_limit_s():.0f} s "
              f"(1.5 x train.collective_timeout_s={self.timeout_s:g}), {self.where()} (this rank)"
              f"{self._reap(silent)}; stopping (exit code 4): check that rank's host, or raise "
              f"train.collective_timeout_s if it legitimately works that long", file=sys.stderr, flush=True)
        os._exit(EXIT_FAULT)

    def _reap(self, silent: List[dict]) -> str:
        """SIGKILL the silent peers that run on this host and were orphaned (their launcher is gone, so nothing
        else will end them); the phrase that says so, or ''."""
        killed = [b["rank"] for b in silent if reap_orphan(b, socket.gethostname())]
        return f"; killed the orphaned rank(s) {killed} (their launcher is gone)" if killed else ""

    # -- who stalled ----------------------------------------------------------------------------------------
    def _read(self, ranks=None) -> Dict[int, dict]:
        seen = {}
        for rank in range(self.world_size) if ranks is None else ranks:
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
        names = ", ".join(_describe(s) for s in stalled)
        return f"stalled: {names}, no heartbeat for {3 * self.interval_s:.0f} s{self._reap(stalled)}"


def _describe(beat: dict) -> str:
    """'rank 1 (pid 123 on host) during step 8' from a rank's last heartbeat."""
    if "pid" not in beat:
        return f"rank {beat['rank']} (it never started beating)"
    phase = beat.get("phase")
    where = f"during step {beat['step'] + 1}" if phase == "step" else f"at step {beat['step']} ({phase})"
    return f"rank {beat['rank']} (pid {beat['pid']} on {beat['host']}) {where}"


def peers_of(rank: int, world_size: int) -> List[int]:
    """The ranks a rank watches: all others in a small world, its ring neighbours in a large one."""
    if world_size <= ALL_PEERS_UP_TO:
        return [r for r in range(world_size) if r != rank]
    return sorted({(rank - 1) % world_size, (rank + 1) % world_size})


def reap_orphan(beat: dict, host: str) -> bool:
    """SIGKILL the process of a silent peer's heartbeat when it runs on `host`, is still the same process (its
    beats named this pid) and its parent is no longer the launcher that started it. True if killed."""
    pid, launcher = beat.get("pid"), beat.get("launcher")
    if beat.get("host") != host or not pid or not launcher or pid == os.getpid():
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/environ", "rb") as fh:
            same_run = f"RANK={beat['rank']}".encode() in fh.read().split(b"\0")
    except (OSError, IndexError):
        return False
    if not same_run or int(fields[1]) == launcher or fields[0] in ("Z", "X"):
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True
