"""The progress watchdog and heartbeats (trainer/resilience/watchdog.py), in one process: who is named as stalled, when the
watchdog fires and when it must not."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tessera.errors import EXIT_FAULT
from trainer.resilience import watchdog

import pytest

REPO = __import__("pathlib").Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def no_active_watchdog_left():
    """Fault messages ask the active watchdog who stalled: none of these may outlive its test."""
    yield
    watchdog._ACTIVE = None


def test_a_rank_that_stops_beating_is_named_with_its_step(tmp_path):
    a = watchdog.Watchdog(str(tmp_path), 0, 3, timeout_s=60, interval_s=0.05)
    b = watchdog.Watchdog(str(tmp_path), 1, 3, timeout_s=60, interval_s=0.05)
    try:
        b.finished_step(7)
        time.sleep(0.2)
        assert a.stalled(window_s=0.3) == [{"rank": 2}]  # rank 2 never beat; rank 1 beats
        b.close()  # as if SIGSTOPped: its beat stops moving
        stalled = a.stalled(window_s=0.3)
        assert [s["rank"] for s in stalled] == [1, 2] and stalled[0]["step"] == 7
        phrase = a.who_stalled()
        assert phrase.startswith("stalled: rank 1 (pid ") and "during step 8" in phrase, phrase
        assert "rank 2 (it never started beating)" in phrase
    finally:
        a.close()
        b.close()


def test_beats_are_whole_files(tmp_path):
    dog = watchdog.Watchdog(str(tmp_path), 0, 1, timeout_s=60, interval_s=0.01)
    try:
        for step in range(200):
            dog.finished_step(step)
            beat = json.loads((tmp_path / ".heartbeat" / "rank-0.json").read_text())  # never half-written
            assert beat["rank"] == 0 and 0 <= beat["step"] <= step
    finally:
        dog.close()
    assert [p.name for p in (tmp_path / ".heartbeat").iterdir()] == ["rank-0.json"]  # no temporary left


def test_a_lone_process_is_not_watched(tmp_path):
    dog = watchdog.start(str(tmp_path), 0, 1, timeout_s=1)
    assert isinstance(dog, watchdog.Unwatched) and not (tmp_path / ".heartbeat").exists()


SCRIPT = """
import sys, time
from trainer.resilience import watchdog
dog = watchdog.Watchdog(sys.argv[1], 0, 2, timeout_s=float(sys.argv[2]), interval_s=0.05)
time.sleep(1.0)                      # start-up (before the first step) is not timed
for step in (1, 2, 3):
    time.sleep(0.1)
    dog.finished_step(step)
with dog.exempt("checkpoint save"):  # a long save is not a stall
    time.sleep(1.0)
print("alive after the save", flush=True)
time.sleep(float(sys.argv[3]))       # a stall after step 3
print("not stopped", flush=True)
"""


def test_no_progress_ends_the_rank_with_exit_4_naming_the_step(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), "0.5", "30"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == EXIT_FAULT, proc.stderr
    assert "alive after the save" in proc.stdout and "not stopped" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[rank 0] error: no progress for "), proc.stderr
    assert "after step 3" in lines[0] and "rank 1 (it never started beating)" in lines[0]
    assert time.monotonic() - t0 < 20


def test_the_limit_grows_with_the_slowest_step(tmp_path):
    dog = watchdog.Watchdog(str(tmp_path), 0, 1, timeout_s=0.1, interval_s=1.0)
    try:
        dog.finished_step(1)
        time.sleep(0.3)
        dog.finished_step(2)
        assert 0.95 <= dog.limit_s() < 2.0  # 3x a 0.3 s step (+ half the timeout), not the 0.1 s timeout
    finally:
        dog.close()


def test_a_silent_peer_is_found_in_any_phase_and_an_ended_one_is_not(tmp_path):
    a = watchdog.Watchdog(str(tmp_path), 0, 3, timeout_s=0.2, interval_s=0.05)  # peers silent after 0.3 s
    b = watchdog.Watchdog(str(tmp_path), 1, 3, timeout_s=0.2, interval_s=0.05)
    c = watchdog.Watchdog(str(tmp_path), 2, 3, timeout_s=0.2, interval_s=0.05)
    try:
        with a.exempt("checkpoint save"):  # exempt from the progress check, not from watching peers
            assert a.silent_peers() == []
            time.sleep(0.5)
            assert a.silent_peers() == []  # both beat
            b.close()  # as if SIGSTOPped
            c.close(ended=True)  # finished its run: its silence is no fault
            time.sleep(0.1)
            a.silent_peers()
            time.sleep(0.4)
            silent = a.silent_peers()
        assert [s["rank"] for s in silent] == [1] and silent[0]["pid"] > 0, silent
        # Stopped first: armed by a finished step, a's thread would report the silent b and end this process
        # (os._exit(4) in the test runner's worker).
        a.close()
        assert a.where() == "in the start-up" and (a.finished_step(4) or a.where()) == "during step 5"
    finally:
        for dog in (a, b, c):
            dog.close()


def test_large_worlds_watch_their_ring_neighbours():
    assert watchdog.peers_of(1, 4) == [0, 2, 3]
    assert watchdog.peers_of(0, 1000) == [1, 999] and watchdog.peers_of(500, 1000) == [499, 501]


SILENT_PEER_SCRIPT = """
import json, os, sys, time
from trainer.resilience import watchdog
folder = os.path.join(sys.argv[1], ".heartbeat")
os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, "rank-1.json"), "w") as fh:  # a peer that beat once, then froze
    json.dump({"rank": 1, "pid": 999999, "host": "elsewhere", "step": 4, "phase": "checkpoint save", "beat": 7,
               "launcher": 1}, fh)
dog = watchdog.Watchdog(sys.argv[1], 0, 2, timeout_s=1.0, interval_s=0.05)
dog.finished_step(4)
with dog.exempt("checkpoint save"):
    time.sleep(30)
print("not stopped", flush=True)
"""


def test_a_silent_peer_during_a_save_ends_the_rank_with_exit_4_naming_both(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SILENT_PEER_SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == EXIT_FAULT and "not stopped" not in proc.stdout, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("[rank 0] error: rank 1 (pid 999999 on elsewhere) at step 4 (checkpoint save) has "
                               "not answered for more than 2 s"), lines[0]
    assert "in the checkpoint save after step 4 (this rank)" in lines[0] and "killed" not in lines[0], lines[0]
    assert time.monotonic() - t0 < 15


ORPHAN_SCRIPT = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=dict(os.environ, RANK="1"))
print(child.pid, os.getpid(), flush=True)
if sys.argv[1] == "orphan":
    os._exit(0)  # the child's launcher is gone: it is re-parented
time.sleep(120)
"""


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.parametrize("orphaned", [True, False])
def test_only_an_orphaned_silent_peer_on_this_host_is_killed(orphaned):
    import socket

    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, "orphan" if orphaned else "keep"],
                              stdout=subprocess.PIPE, text=True)
    child, launcher = map(int, parent.stdout.readline().split())
    try:
        os.kill(child, 19)  # SIGSTOP: a Python handler could not end it
        # Popen returns before the child's exec has set up its environment (/proc/<pid>/environ reads empty until
        # then); the stop takes effect only once exec is done, so wait for it (under load this took seconds)
        deadline = time.monotonic() + 30
        while _state(child) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(child) == "T", _state(child)
        parent.wait(timeout=30) if orphaned else time.sleep(0.2)
        beat = {"rank": 1, "pid": child, "host": socket.gethostname(), "launcher": launcher}
        assert not watchdog.reap_orphan(dict(beat, host="another-host"), socket.gethostname())
        assert not watchdog.reap_orphan(dict(beat, rank=3), socket.gethostname())  # another process
        assert watchdog.reap_orphan(beat, socket.gethostname()) == orphaned
        time.sleep(0.5)
        state = _state(child)
        assert (state in ("gone", "Z")) == orphaned, state
    finally:
        for pid in (child, parent.pid):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        parent.wait()


GROUP_SCRIPT = """
import datetime, os, sys, time
import torch, torch.distributed as dist
from trainer.parallel import dims as parallel
parallel.init_process_group(torch.device("cpu"), 2.0)
group = dist.new_group(backend="gloo")  # made without a timeout, as DCP's, DeviceMesh's and DeepSpeed's are
if dist.get_rank() == 1:
    time.sleep(20)  # never joins
    sys.exit(0)
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(1), group=group)
except Exception as e:
    print(f"raised after {time.monotonic() - t0:.1f} s", flush=True)
    os._exit(0)
os._exit(1)
"""


def test_groups_made_later_inherit_the_collective_timeout(tmp_path):
    from trainer.parallel.dims import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", GROUP_SCRIPT], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                                       WORLD_SIZE="2", LOCAL_RANK=str(r), PYTHONPATH=str(REPO)))
             for r in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 0 and out.startswith("raised after "), out
    assert float(out.split()[2]) < 10, out  # the 2 s of train.collective_timeout_s, not torch's 30 minutes
