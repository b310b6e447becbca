"""The run directory (trainer/resilience/rundir.py) and the JSON logs (trainer/observe/metrics.py): what counts as another run,
the refusal and the move aside, the lock (held, released, left by a dead process), valid JSON for non-finite
values, and the rewrite of a log on resume."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from trainer.checkpoint import resume_plan
from trainer.resilience import rundir
from tessera.errors import FaultError
from trainer.observe.metrics import MetricsLogger, json_line, truncate_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def claim(run_dir, resume="none", overwrite=False, weights_only=False):
    run_dir = str(run_dir)
    rundir.claim(run_dir, resume_plan.plan_for(resume, weights_only, run_dir), overwrite)


@pytest.fixture(autouse=True)
def rank0(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    yield
    for path in rundir.held():
        rundir.release(path)


def old_run(d):
    """A finished run's folder as Hydra and the trainer leave it."""
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text("a: 1\n")
    (d / "checkpoints" / "step_2").mkdir(parents=True)
    (d / "checkpoints" / "step_2" / "COMPLETE.json").write_text("{}")
    (d / "checkpoints" / "latest").write_text("step_2\n")
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (d / "config.yaml").write_text("x: 1\n")
    (d / "main.log").write_text("log\n")
    return d


# ---- JSON logs -------------------------------------------------------------------------------------------------

def test_non_finite_values_are_written_as_null():
    line = json_line({"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3,
                      "nested": {"a": float("-inf")}, "n": 7})
    rec = json.loads(line)  # strict JSON: json.loads would accept NaN, so check the text as well
    assert "NaN" not in line and "Infinity" not in line and line.endswith("\n")
    assert rec == {"step": 3, "loss": None, "grad_norm": None, "lr": 1e-3, "nested": {"a": None}, "n": 7}


def test_logger_writes_valid_json_and_console_still_shows_nan(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path), True, 10, 0, progress=False, tensorboard=False)
    rec = {"step": 1, "loss": float("nan"), "lr": 1e-3, "grad_norm": float("nan"), "tokens": 8,
           "tokens_per_s": 1.0}
    log.advance(1, rec)
    log.eval_record(1, {"val_loss": float("nan"), "val_ppl": float("inf")})
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] is None
    assert json.loads((tmp_path / "eval.jsonl").read_text()) == {"step": 1, "val_loss": None, "val_ppl": None}
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text() + (tmp_path / "eval.jsonl").read_text()
    assert "loss nan" in capsys.readouterr().err


def test_truncate_keeps_earlier_steps_and_drops_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    assert truncate_jsonl(str(path), lambda s: s <= 4) == 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert path.read_text().endswith("\n")
    before = path.stat().st_mtime_ns
    assert truncate_jsonl(str(path), lambda s: s <= 4) == 0 and path.stat().st_mtime_ns == before  # untouched
    assert truncate_jsonl(str(tmp_path / "missing.jsonl"), lambda s: True) == 0


def test_logger_resume_rewrites_both_logs(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)) + "{")
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": s, "val_loss": 1.0}) + "\n" for s in (0, 2, 4, 6)))
    log = MetricsLogger(str(tmp_path), True, 10, 0, progress=False, tensorboard=False)
    log.resume(4)
    log.advance(5, {"step": 5, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 8, "tokens_per_s": 1.0})
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert [json.loads(x)["step"] for x in (tmp_path / "eval.jsonl").read_text().splitlines()] == [0, 2, 4]
    log = MetricsLogger(str(tmp_path), True, 10, 0, progress=False, tensorboard=False)
    log.resume(0)  # started over (resume=auto without a checkpoint): the step-0 evaluation is made again
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == "" and (tmp_path / "eval.jsonl").read_text() == ""


def test_full_disk_while_logging_is_a_fault_naming_the_file(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    os.symlink("/dev/full", tmp_path / "metrics.jsonl")
    log = MetricsLogger(str(tmp_path), True, 10, 0, progress=False, tensorboard=False)
    with pytest.raises(FaultError, match="metrics.jsonl failed: No space left on device") as e:
        log.advance(1, {"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 8, "tokens_per_s": 1.0})
    assert e.value.exit_code == 4
    log.close()


def test_unwritable_folder_is_a_fault_naming_the_file(tmp_path):
    missing = tmp_path / "gone"  # as good as read-only for open(): the folder is not there
    with pytest.raises(FaultError, match="metrics.jsonl failed"):
        MetricsLogger(str(missing), True, 10, 0, progress=False, tensorboard=False)


# ---- another run in the folder ---------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ["checkpoints/step_4", "checkpoints/.tmp-step_6", "metrics.jsonl", "eval.jsonl",
                                   "hf/", "snapshots/"])
def test_any_trace_of_another_run_is_found(tmp_path, entry):
    target = tmp_path / entry.rstrip("/")
    if entry.startswith("checkpoints") or entry in ("hf/", "snapshots/"):
        target.mkdir(parents=True)
        if entry in ("hf/", "snapshots/"):
            (target / "config.json").write_text("{}")
    else:
        target.write_text('{"step": 1}\n')
    assert rundir.leftovers(str(tmp_path)) == [entry]


def test_hydra_files_lock_empty_logs_and_earlier_moves_are_no_run(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".lock").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "previous-20240101-000000" / "checkpoints" / "step_2").mkdir(parents=True)
    assert rundir.leftovers(str(tmp_path)) == []
    claim(tmp_path)


def test_which_launches_continue_the_run(tmp_path):
    d = str(tmp_path)

    def continues(resume, weights_only=False):
        return resume_plan.plan_for(resume, weights_only, d).continues_run

    assert continues("auto")
    assert continues(str(tmp_path / "checkpoints" / "step_2"))
    assert not continues("none")
    assert not continues(str(tmp_path / "checkpoints" / "step_2"), weights_only=True)
    assert not continues("/elsewhere/checkpoints/step_2")


def test_new_run_is_refused_and_nothing_changes(tmp_path):
    d = old_run(tmp_path / "run")
    listing = sorted((str(p), p.stat().st_mtime_ns) for p in d.rglob("*"))
    with pytest.raises(rundir.RunDirError) as e:
        claim(d)
    msg = str(e.value)
    assert e.value.exit_code == 2 and str(d) in msg and "checkpoints/step_2, metrics.jsonl" in msg
    for way in ("checkpoint.resume=auto", "hydra.run.dir", "checkpoint.overwrite=true"):
        assert way in msg
    assert sorted((str(p), p.stat().st_mtime_ns) for p in d.rglob("*") if p.name != ".lock") == listing
    assert not rundir.held()  # the refused launch let the lock go
    claim(d, "auto")  # continuing is fine


def test_overwrite_moves_the_old_run_aside(tmp_path):
    d = old_run(tmp_path / "run")
    (d / "previous-20240101-000000").mkdir()
    claim(d, overwrite=True)
    prev = [p for p in d.iterdir() if p.name.startswith("previous-") and p.name != "previous-20240101-000000"]
    assert len(prev) == 1
    assert sorted(p.name for p in prev[0].iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl"]
    assert (prev[0] / "checkpoints" / "step_2" / "COMPLETE.json").exists()
    assert sorted(p.name for p in d.iterdir()) == sorted([".hydra", ".lock", "main.log", "previous-20240101-000000",
                                                          prev[0].name])
    assert rundir.leftovers(str(d)) == []


def test_other_ranks_refuse_the_same_and_never_move(tmp_path, monkeypatch):
    d = old_run(tmp_path / "run")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(rundir.RunDirError, match="checkpoint.overwrite=true"):
        claim(d)
    claim(d, overwrite=True)
    assert rundir.leftovers(str(d)) == ["checkpoints/step_2", "metrics.jsonl"]  # only rank 0 moves
    assert not rundir.held()


# ---- the lock --------------------------------------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from trainer.checkpoint import resume_plan
    from trainer.resilience import rundir
    rundir.claim(sys.argv[1], resume_plan.plan_for("none", False, sys.argv[1]), False)
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
""")


def _holder(d, seconds):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=REPO), str(d), str(seconds)],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, RANK="0", WORLD_SIZE="1"))
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_live_job_holds_the_lock_and_a_dead_one_never_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "RANK0_WAIT_S", 0.2)
    monkeypatch.setattr(rundir, "OTHER_RANK_WAIT_S", 0.3)
    d = tmp_path / "run"
    d.mkdir()
    proc = _holder(d, 60)
    try:
        body = json.loads((d / ".lock").read_text())
        assert body["pid"] == proc.pid and body["host"] and body["since"] and "python" in body["command"]
        with pytest.raises(rundir.RunDirError) as e:
            claim(d, "auto")
        assert f"pid {proc.pid} on host {body['host']}" in str(e.value) and str(d) in str(e.value)
        assert e.value.exit_code == 2
        monkeypatch.setenv("RANK", "1")  # another job's rank 1 sees it too (not its own rank 0)
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(rundir.RunDirError, match=f"pid {proc.pid}"):
            claim(d, "auto")
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
    finally:
        proc.kill()
        proc.wait()
    t0 = time.perf_counter()
    claim(d, "auto")  # the dead holder's lock (file and body still there) does not block
    assert time.perf_counter() - t0 < 1.0
    assert json.loads((d / ".lock").read_text())["pid"] == os.getpid()
    rundir.release(str(d))
    assert not rundir.held()


def test_rank_1_of_the_same_job_accepts_its_rank_0(tmp_path, monkeypatch):
    d = tmp_path / "run"
    d.mkdir()
    claim(d)  # "rank 0" here: this process, as a lone job
    monkeypatch.setattr(rundir, "job_token", lambda: json.loads((d / ".lock").read_text())["job"])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(rundir, "OTHER_RANK_WAIT_S", 0.3)
    claim(d)  # as rank 1: the lock is held (flock of another open file), by its own job: fine
