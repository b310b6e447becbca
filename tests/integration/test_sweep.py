"""Hydra multirun of distributed jobs (`./launch.sh -m ...`, hydra/launcher=tessera): each point is a launch of
launch.sh (torchrun at 2 ranks for strategy=ddp) in <sweep dir>/<job>, a failed point does not stop the sweep, and
the summary table (printed, summary.md, summary.json) holds every job's overrides, numbers and exit status; the
sweep exits with the failed job's code."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.integration.conftest import REPO, SMALL, metrics, read_jsonl
from trainer.launch.choose import run_process_group

RUN = SMALL + ["train.max_steps=3", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2",
               "eval.every=0", "eval.max_sequences=8", "export.hf_at_end=false", "checkpoint.at_end=false"]


def test_a_sweep_runs_distributed_jobs_past_a_failure_and_ends_with_a_summary(tmp_path):
    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1", TESSERA_VENV=str(Path(sys.executable).parents[1]))
    proc = run_process_group([str(REPO / "launch.sh"), "-m", "strategy=ddp", "optim.lr=1e-3,-1,3e-4", *RUN,
                              f"hydra.sweep.dir={tmp_path}"], env=env, timeout=400)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]  # job 1's exit code (a bad optim.lr)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(s["job"], s["overrides"], s["exit_code"]) for s in summary] == [
        (0, ["optim.lr=0.001"], 0), (1, ["optim.lr=-1"], 2), (2, ["optim.lr=0.0003"], 0)]
    for job in (0, 2):
        log = (tmp_path / str(job) / "launch.log").read_text()
        assert "world 2 (dp 2)" in log, log[-2000:]  # a distributed job of its own
        assert summary[job]["final_loss"] == metrics(tmp_path / str(job))[-1]["loss"]
        assert summary[job]["val_loss"] == read_jsonl(tmp_path / str(job) / "eval.jsonl")[-1]["val_loss"]
    assert "optim.lr" in (tmp_path / "1" / "launch.log").read_text()  # the failed job's own message
    assert summary[1]["final_loss"] is None and not (tmp_path / "1" / "metrics.jsonl").exists()
    table = (tmp_path / "summary.md").read_text()
    assert "| 1 | `optim.lr=-1` | failed (exit 2) | - |" in table and table.splitlines()[-1] in proc.stdout
