"""Experiment trackers through the real entry point: W&B (offline) and MLflow (its default store in the run
directory) on a DDP run of 2 ranks under torchrun, resumed with checkpoint.resume=auto from a checkpoint older than
what the trackers already hold. Both trackers hold exactly metrics.jsonl and eval.jsonl, each step once, in one
tracker run across both launches, whose id every checkpoint records."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.integration.conftest import SMALL, launch, metrics, ok, read_jsonl
from tests.tracker_logs import mlflow_history, mlflow_run, wandb_history, wandb_run_ids, wandb_summary

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

# 6 steps, checkpoints at 2, 4 and 6, an evaluation before the first step and every 2 steps, both trackers on. A
# constant learning rate: the resumed launch raises train.max_steps, which would stretch a decaying schedule, and
# then steps 5 and 6 would not repeat exactly (the trackers keep their first values; metrics.jsonl the new ones).
BASE = SMALL + ["strategy=ddp", "scheduler=constant", "train.global_batch_size=4", "train.micro_batch_size=2",
                "train.log_every=1", "eval.every=2", "eval.at_start=true", "eval.max_sequences=8", "checkpoint.every=2",
                "checkpoint.keep_last=0", "logging.wandb=true", "logging.mlflow=true"]


def _meta(run_dir, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step}" / "meta.json").read_text())


def test_both_trackers_hold_the_run_once_across_a_resume(tmp_path):
    run_dir, wandb_dir = tmp_path / "run", tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": ""}
    ok(launch("torchrun", BASE + ["train.max_steps=6"], run_dir, nproc=2, env=env))
    ids = _meta(run_dir, 6)["trackers"]
    assert _meta(run_dir, 2)["trackers"] == _meta(run_dir, 4)["trackers"] == ids
    # The trackers hold steps 1-6; the newest checkpoint left is step 4: the resumed launch repeats steps 5 and 6
    shutil.rmtree(run_dir / "checkpoints" / "step_6")
    proc = launch("torchrun", BASE + ["train.max_steps=8", "checkpoint.resume=auto"], run_dir, nproc=2, env=env)
    ok(proc)
    out = proc.stdout + proc.stderr
    assert "resumed from" in out and "step_4" in out and "which are not sent again" in out
    assert _meta(run_dir, 8)["trackers"] == ids

    recs, evals = metrics(run_dir), read_jsonl(run_dir / "eval.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 9)) and [e["step"] for e in evals] == [0, 2, 4, 6, 8]

    uri, run_id = ids["mlflow"]["tracking_uri"], ids["mlflow"]["run_id"]
    assert uri == f"sqlite:///{run_dir}/mlflow.db"
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert mlflow_history(uri, run_id, key) == [(r["step"], r[key]) for r in recs], key
    for key in ("val_loss", "val_ppl"):
        assert mlflow_history(uri, run_id, key) == [(e["step"], e[key]) for e in evals], key
    run = mlflow_run(uri, run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.max_steps"] == "6"
    assert run.data.tags["resumed_at_step_4"] == "train.max_steps=8 (was 6); checkpoint.resume=auto (was none)"
    assert run.data.tags["checkpoint/step_8"] == str(run_dir / "checkpoints" / "step_8")
    assert run.data.tags["export/hf"] == str(run_dir / "hf")
    from mlflow.tracking import MlflowClient

    assert len(MlflowClient(uri).search_runs([run.info.experiment_id])) == 1

    wandb_id = ids["wandb"]["run_id"]
    assert wandb_run_ids(str(wandb_dir), launches=2) == [wandb_id, wandb_id]  # one run, continued by the second launch
    rows = wandb_history(str(wandb_dir), wandb_id)
    assert [step for step, _ in rows] == list(range(0, 9))
    by_step = dict(rows)
    for r in recs:
        assert {k: by_step[r["step"]][k] for k in ("loss", "grad_norm", "lr")} == \
            {k: r[k] for k in ("loss", "grad_norm", "lr")}, r["step"]
    for e in evals:
        assert (by_step[e["step"]]["val_loss"], by_step[e["step"]]["val_ppl"]) == (e["val_loss"], e["val_ppl"])
    summary = wandb_summary(str(wandb_dir), wandb_id)
    assert summary["final/steps"] == 8 and summary["final/loss"] == recs[-1]["loss"]
    assert summary["final/val_loss"] == evals[-1]["val_loss"] and summary["final/tokens"] == recs[-1]["tokens"]
    assert summary["checkpoint/latest"] == str(run_dir / "checkpoints" / "step_8")
