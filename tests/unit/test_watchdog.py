"""The progress watchdog and heartbeats (trainer/watchdog.py), in one process: who is named as stalled, when the
watchdog fires and when it must not."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from tessera.errors import EXIT_FAULT
from trainer import watchdog

import pytest

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


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
from trainer import watchdog
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
