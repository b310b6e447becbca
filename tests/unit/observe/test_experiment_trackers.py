"""Experiment trackers (trainer/observe/trackers.py) with the real libraries, W&B offline and MLflow on a local
sqlite store, fed through the metrics logger as the loop feeds it: records read back value for value, a resumed
launch that continues the same tracker run without sending a step twice, a failing tracker that warns once and
never raises, and a tracker that is not installed as a config error."""
from __future__ import annotations

import random
import sys
import time

import numpy as np
import pytest
import torch

from tests.conftest import compose_config
from tests.tracker_logs import mlflow_history, mlflow_run, wandb_history, wandb_run_ids, wandb_summary
from tessera.errors import ConfigError
from trainer.observe.metrics import MetricsLogger
from trainer.observe.trackers import (MARKS_FILE, MlflowTracker, TrackerSettings, Trackers, WandbTracker,
                                      config_problems, open_trackers, read_marks)

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

CONFIG = {"train": {"max_steps": 6, "lr": 0.001}, "model": {"kind": "llama"}}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def record(step: int) -> dict:
    """A metrics.jsonl record as the loop writes it (with a mixture's per-task figures), a function of the step:
    an exact resume repeats it."""
    return {"step": step, "loss": 5.0 / step + 0.125, "lr": 1e-3 * step, "grad_norm": 2.0 + step / 8,
            "tokens": 64 * step, "tokens_per_s": 100.0, "tasks": {"a": {"loss": 4.0 / step, "tokens": 32 * step}}}


def evaluation(step: int) -> dict:
    return {"val_loss": 6.0 / (step + 1), "val_ppl": 2.0 + step}


def attempt(tracker, run_dir, first: int, last: int, config=CONFIG, state=None, continues=False, checkpoint=None,
            saves=()) -> dict:
    """One launch through the metrics logger: the step-0 evaluation when starting at 0, steps first+1..last with an
    evaluation every 2 steps (its figures in the metrics record too, as the loop does); the trackers' state saved
    at each step in `saves` (what a checkpoint keeps)."""
    trackers = Trackers([tracker], str(run_dir), config)  # the logger's console says what they do
    if state is not None:
        trackers.load_state_dict(state)
    log = MetricsLogger(str(run_dir), True, last, first, progress=False, tensorboard=False, trackers=trackers)
    if continues:
        log.resume(first)
    log.start_trackers(first, continues, checkpoint)
    if first == 0:
        log.eval_record(0, evaluation(0))
    saved = {}
    for step in range(first + 1, last + 1):
        rec = record(step)
        if step % 2 == 0:
            log.eval_record(step, evaluation(step))
            rec.update(evaluation(step))
        log.advance(step, rec)
        if step in saves:
            saved[step] = trackers.state_dict()
            log.checkpoint_saved(step, f"{run_dir}/checkpoints/step_{step}")
    log.exported([f"{run_dir}/hf"])
    log.close()
    return saved


def settings(run_dir, uri=None) -> TrackerSettings:
    return TrackerSettings(str(run_dir), "tessera-tests", "unit/run", uri)


def test_wandb_offline_holds_every_record_once_across_a_resume(tmp_path, capsys):
    """6 steps with checkpoints at 2 and 4; a launch resumed from 4 to 8 in the same run directory: one W&B run,
    each step once (5 and 6 not sent again), values as logged, per-task figures flattened."""
    saved = attempt(WandbTracker(settings(tmp_path)), tmp_path, 0, 6, saves=(2, 4))
    run_id = saved[4]["wandb"]["run_id"]
    assert saved[2] == saved[4] and read_marks(str(tmp_path))["wandb"]["metrics_through"] == 6
    capsys.readouterr()
    # W&B names an offline launch's folder by the second it started (offline-run-<YYYYmmdd_HHMMSS>-<id>): a second
    # launch of the same run within that second would write into the first one's folder. Real launches are seconds
    # apart; here the next one waits for the next second.
    time.sleep(1.05 - time.time() % 1)
    attempt(WandbTracker(settings(tmp_path)), tmp_path, 4, 8, state=saved[4], continues=True)
    said = capsys.readouterr().err  # the logger's console
    assert f"tracking with W&B run {run_id} (continued, offline in {tmp_path}/wandb/" in said
    assert "it holds steps up to 6, which are not sent again" in said
    assert wandb_run_ids(str(tmp_path), launches=2) == [run_id, run_id]
    rows = wandb_history(str(tmp_path), run_id)
    assert [step for step, _ in rows] == list(range(9))
    for step, values in rows:
        expected = dict(evaluation(step)) if step % 2 == 0 else {}
        if step:
            rec = record(step)
            expected.update({k: rec[k] for k in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s")})
            expected.update({f"tasks/a/{k}": v for k, v in rec["tasks"]["a"].items()})
        assert values == expected, (step, values, expected)
    summary = wandb_summary(str(tmp_path), run_id)
    assert summary["final/steps"] == 8 and summary["final/loss"] == record(8)["loss"]
    assert summary["final/val_loss"] == evaluation(8)["val_loss"] and summary["final/tokens"] == 64 * 8
    assert summary["checkpoint/step_4"] == f"{tmp_path}/checkpoints/step_4"
    assert summary["export/hf"] == f"{tmp_path}/hf"


def test_mlflow_continues_the_checkpoints_run_from_a_fresh_run_directory(tmp_path):
    """The first launch logs to sqlite:///<run dir>/mlflow.db; a resume from its step-4 checkpoint into another run
    directory (with a changed train.max_steps) continues the same MLflow run in the first run's store, and steps 5
    and 6, which the run holds already, are not logged twice."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    saved = attempt(MlflowTracker(settings(first)), first, 0, 6, saves=(2, 4))
    state = saved[4]["mlflow"]
    uri, run_id = state["tracking_uri"], state["run_id"]
    assert uri == f"sqlite:///{first}/mlflow.db"
    changed = {**CONFIG, "train": {**CONFIG["train"], "max_steps": 8}}
    attempt(MlflowTracker(settings(second)), second, 4, 8, config=changed, state=saved[4], continues=True,
            checkpoint=f"{first}/checkpoints/step_4")
    assert read_marks(str(second))["mlflow"]["run_id"] == run_id
    assert not (second / "mlflow.db").exists()
    for key, steps in (("loss", range(1, 9)), ("grad_norm", range(1, 9)), ("lr", range(1, 9))):
        assert mlflow_history(uri, run_id, key) == [(s, record(s)[key]) for s in steps], key
    assert mlflow_history(uri, run_id, "tasks/a/loss") == [(s, 4.0 / s) for s in range(1, 9)]
    assert mlflow_history(uri, run_id, "val_loss") == [(s, evaluation(s)["val_loss"]) for s in range(0, 9, 2)]
    run = mlflow_run(uri, run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "unit/run"
    assert run.data.params["train.max_steps"] == "6" and run.data.params["model.kind"] == "llama"
    assert run.data.tags["resumed_at_step_4"] == "train.max_steps=8 (was 6)"
    assert run.data.tags["checkpoint/step_4"] == f"{first}/checkpoints/step_4"
    assert run.data.tags["export/hf"] == f"{second}/hf"
    assert run.data.metrics["final/steps"] == 8 and run.data.metrics["final/loss"] == record(8)["loss"]


def test_a_tracker_that_fails_warns_once_and_training_goes_on(tmp_path, monkeypatch, capsys):
    """The library raises inside log (W&B: a network error; MLflow: a full disk): one message naming the key, no
    exception reaches the caller, the other tracker keeps logging, and the run still closes."""
    import wandb
    from mlflow.tracking import MlflowClient

    def network_down(*args, **kwargs):
        raise ConnectionError("network is unreachable")

    trackers = Trackers([WandbTracker(settings(tmp_path)), MlflowTracker(settings(tmp_path))], str(tmp_path), CONFIG)
    log = MetricsLogger(str(tmp_path), True, 6, 0, progress=False, tensorboard=False, trackers=trackers)
    log.start_trackers(0, False, None)
    log.advance(1, record(1))
    state = trackers.state_dict()  # waits for both runs to have started
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", network_down)
    for step in range(2, 7):
        log.advance(step, record(step))
    log.close()
    said = capsys.readouterr().err  # the logger's console
    failures = [line for line in said.splitlines() if "failed" in line]
    assert failures == ["logging.wandb: W&B failed (network is unreachable); training goes on without it "
                        "(metrics.jsonl and eval.jsonl hold every record)"], said
    uri, run_id = state["mlflow"]["tracking_uri"], state["mlflow"]["run_id"]
    assert [s for s, _ in mlflow_history(uri, run_id, "loss")] == list(range(1, 7))

    said = []
    broken = MlflowTracker(settings(tmp_path / "mlflow-disk-full"))
    trackers = Trackers([broken], str(tmp_path), CONFIG, say=said.append)
    trackers.start(0, False)
    trackers.state_dict()
    monkeypatch.setattr(MlflowClient, "log_batch", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space")))
    for step in range(1, 4):
        trackers.log_metrics(step, {"loss": 1.0})
    trackers.finish({}, 3, True)
    assert [m for m in said if "failed" in m] == ["logging.mlflow: MLflow failed ([Errno 28] No space); training "
                                                  "goes on without it (metrics.jsonl and eval.jsonl hold every "
                                                  "record)"], said


def test_a_store_that_cannot_be_opened_is_one_warning(tmp_path):
    """The tracker fails at its start (MLflow cannot create its database under a file): one message, nothing
    raised, no run id for a checkpoint."""
    (tmp_path / "a-file").write_text("")
    said = []
    trackers = Trackers([MlflowTracker(settings(tmp_path, uri=f"sqlite:///{tmp_path}/a-file/mlflow.db"))],
                        str(tmp_path), CONFIG, say=said.append)
    trackers.start(0, False)
    for step in range(1, 4):
        trackers.log_metrics(step, {"loss": 1.0})
    trackers.finish({"final/loss": 1.0}, 3, True)
    assert len([m for m in said if "logging.mlflow: MLflow failed" in m]) == 1, said
    assert trackers.state_dict() == {}


def test_trackers_leave_the_random_generators_alone(tmp_path):
    """Fixed-seed numbers: a run with both trackers draws nothing from Python's, NumPy's or torch's generators."""
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    attempt(WandbTracker(settings(tmp_path)), tmp_path, 0, 2)
    attempt(MlflowTracker(settings(tmp_path)), tmp_path, 0, 2)
    after = (random.getstate(), np.random.get_state()[1], torch.get_rng_state())
    assert before[0] == after[0] and (before[1] == after[1]).all() and torch.equal(before[2], after[2])


def test_trackers_are_off_by_default_and_only_on_rank_0(tmp_path):
    cfg = compose_config([])
    assert open_trackers(cfg, str(tmp_path), True).trackers == []
    on = compose_config(["logging.wandb=true", "logging.mlflow=true"])
    assert [t.name for t in open_trackers(on, str(tmp_path), True).trackers] == ["wandb", "mlflow"]
    assert open_trackers(on, str(tmp_path), False).trackers == []
    log = MetricsLogger(str(tmp_path), True, 2, 0, progress=False, tensorboard=False)
    log.start_trackers(0, False, None)
    log.advance(1, record(1))
    log.close()
    assert not (tmp_path / MARKS_FILE).exists()


def test_a_checkpoint_keeps_the_run_of_a_tracker_that_is_off_now():
    trackers = Trackers()
    trackers.load_state_dict({"wandb": {"run_id": "abc123", "project": "p", "entity": None}})
    assert trackers.state_dict() == {"wandb": {"run_id": "abc123", "project": "p", "entity": None}}


def test_a_checkpoint_saved_before_trackers_existed_still_loads(tmp_path):
    """meta.json without a `trackers` entry: the other states load, the trackers have no run to continue."""
    from types import SimpleNamespace

    from trainer.checkpoint.manager import CheckpointManager
    from trainer.run.state import TrainState

    progress, trackers = TrainState(), Trackers()
    manager = SimpleNamespace(states={"progress": progress, "trackers": trackers}, rank=0, strategy=None)
    CheckpointManager._load_states(manager, str(tmp_path), {"step": 4, "tokens_seen": 8, "skipped_steps": 0})
    assert progress.step == 4 and trackers.state_dict() == {}


@pytest.mark.parametrize("package,key", [("wandb", "logging.wandb"), ("mlflow", "logging.mlflow")])
def test_a_tracker_that_is_not_installed_is_a_config_error(monkeypatch, capsys, package, key):
    """Exit code 2 with one message naming the key, from the checks that run before any process group."""
    from trainer.run import build as B
    from trainer.run.cli import user_errors

    monkeypatch.setitem(sys.modules, package, None)  # an import of it now fails, as when it is not installed
    cfg = compose_config([f"{key}=true"])
    assert config_problems(cfg) == [f"{key}=true needs the {package} package, which is not installed: pip install "
                                    f"{package} (or the project's trackers extra), or set {key}=false"]
    with pytest.raises(ConfigError):
        B.check(cfg, 1)
    with pytest.raises(SystemExit) as exit_:
        with user_errors():
            B.check(cfg, 1)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"{key}=true needs the {package} package" in err and "Traceback" not in err
