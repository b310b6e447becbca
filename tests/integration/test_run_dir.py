"""The run directory belongs to one run and one live job: a new run in a finished run's folder is refused (or,
with checkpoint.overwrite=true, moves the old run aside), a second job next to a live one is refused naming it,
a resumed run's logs are one series even after a killed attempt, and a log that cannot be written is a fault."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.integration.catalogue import Timer, check_case
from tests.integration.conftest import REPO, SMALL, launch, metrics, ok, read_jsonl

BASE = SMALL + ["strategy=single", "data.embedded_documents=12", "train.global_batch_size=8",
                "train.micro_batch_size=2", "train.log_every=1", "eval.every=0", "eval.at_end=false",
                "export.hf_at_end=false", "checkpoint.keep_last=0"]


def _listing(run_dir) -> list:
    """Every file and folder of the run with its size and mtime (Hydra rewrites its own .hydra/ each launch)."""
    return sorted((str(p.relative_to(run_dir)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in run_dir.rglob("*") if ".hydra" not in p.parts)


def test_new_run_in_a_finished_run_dir_is_refused_then_overwrite_moves_it_aside(tmp_path):
    run_dir = tmp_path / "run"
    ok(launch("python", BASE + ["train.max_steps=4", "checkpoint.every=2"], run_dir))
    before = _listing(run_dir)
    assert any(name == "checkpoints/step_4" for name, _, _ in before)

    with Timer() as t:
        proc = launch("python", BASE + ["train.max_steps=4"], run_dir, timeout=120)
    msg = check_case("run-dir-holds-another-run", proc, t.seconds, 2, "checkpoint.overwrite=true")
    assert str(run_dir) in msg and "checkpoint.resume=auto" in msg and "hydra.run.dir" in msg, msg
    assert _listing(run_dir) == before  # nothing touched

    with Timer() as t:  # every rank refuses the same, before any process group: no rank is left waiting
        proc = launch("torchrun-quiet", BASE[:-1] + ["strategy=ddp", "train.max_steps=4"], run_dir, nproc=2,
                      timeout=120)
    check_case("run-dir-holds-another-run-2-ranks", proc, t.seconds, 2, "checkpoint.overwrite=true")
    assert _listing(run_dir) == before

    proc = launch("python", BASE + ["train.max_steps=3", "checkpoint.overwrite=true"], run_dir)
    ok(proc)
    previous = [p for p in run_dir.iterdir() if p.name.startswith("previous-")]
    assert len(previous) == 1 and "moved the earlier run's files" in proc.stdout + proc.stderr
    moved = [(name[len(previous[0].name) + 1:], size, mtime) for name, size, mtime in _listing(run_dir)
             if name.startswith(previous[0].name + "/")]
    assert moved == [entry for entry in before if entry[0] != ".lock"]  # all of it, untouched
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]  # the new run's own series
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_3"]


def test_second_job_in_a_live_run_dir_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "trainer" / "main.py")] + BASE + ["train.max_steps=100000",
                                                                        f"hydra.run.dir={run_dir}"]
    first = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 180
        while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").stat().st_size > 0):
            assert first.poll() is None and time.time() < deadline, "the first run ended early"
            time.sleep(0.1)
        body = json.loads((run_dir / ".lock").read_text())
        assert body["pid"] == first.pid and "main.py" in body["command"]
        for case, extra in (("run-dir-in-use", []), ("run-dir-in-use-resume", ["checkpoint.resume=auto"])):
            with Timer() as t:
                proc = launch("python", BASE + ["train.max_steps=100000"] + extra, run_dir, timeout=120)
            msg = check_case(case, proc, t.seconds, 2, f"pid {first.pid}")
            assert "another job is running" in msg and body["host"] in msg and str(run_dir) in msg, msg
        assert first.poll() is None  # the live job goes on
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=120)
        assert first.returncode == 0 and "stopped by SIGTERM" in out, out[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate()
    # The ended job's lock (its file and body are left behind) blocks nobody.
    ok(launch("python", BASE + ["train.max_steps=2", "checkpoint.overwrite=true"], run_dir))
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]


def test_resume_after_a_killed_attempt_logs_one_series(tmp_path):
    steps = ["train.max_steps=10", "eval.every=2", "checkpoint.every=2"]
    straight = tmp_path / "straight"
    ok(launch("python", BASE + steps + ["checkpoint.at_end=false"], straight))

    # Killed while saving step 6: steps 5-6 (and the step-6 evaluation) were logged after the newest complete
    # checkpoint (step 4); a crash also cut the last line short.
    run_dir = tmp_path / "run"
    fault_worker = REPO / "tests" / "integration" / "fault_worker.py"  # trainer/main.py, paused inside one save
    cmd = [sys.executable, str(fault_worker), "--pause-save=6:60"] + BASE + steps + [f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        partial = run_dir / "checkpoints" / ".tmp-step_6" / "rng" / "rank_0.pt"
        deadline = time.time() + 180
        while not partial.exists():
            assert proc.poll() is None and time.time() < deadline, "the run ended before the step-6 save"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_jsonl(run_dir / "eval.jsonl")] == [2, 4, 6]
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 7, "loss": 1.2')

    resumed = launch("python", BASE + steps + ["checkpoint.resume=auto"], run_dir)
    ok(resumed)
    assert "step_4 at step 4" in resumed.stdout + resumed.stderr
    got, want = metrics(run_dir), metrics(straight)
    assert [r["step"] for r in got] == list(range(1, 11))  # one series: no step twice, none out of order
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # fp32, one process: exactly the same
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [r["step"] for r in evals] == [2, 4, 6, 8, 10]
    assert [r["val_loss"] for r in evals] == [r["val_loss"] for r in read_jsonl(straight / "eval.jsonl")]


def test_a_log_that_cannot_be_written_is_a_fault_naming_it(tmp_path):
    if not os.path.exists("/dev/full"):
        import pytest

        pytest.skip("no /dev/full")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink("/dev/full", run_dir / "metrics.jsonl")  # every write: ENOSPC, as on a full disk
    with Timer() as t:
        proc = launch("python", BASE + ["train.max_steps=4"], run_dir, timeout=120)
    msg = check_case("metrics-log-disk-full", proc, t.seconds, 4, "metrics.jsonl failed: No space left on device")
    assert str(run_dir / "metrics.jsonl") in msg, msg
