"""The sweep summary of hydra/launcher=tessera (trainer/launch/sweep.py): the overrides that name each job, the
table, the sweep's exit code."""
from __future__ import annotations

import json

from trainer.launch.sweep import JobOutcome, summary_table, sweep_exit_code, varying, write_summary


def test_a_job_is_named_by_what_the_sweep_varies():
    jobs = [["strategy=ddp", "optim.lr=1e-3", "train.seed=1"], ["strategy=ddp", "optim.lr=3e-4", "train.seed=1"]]
    assert varying(jobs) == [["optim.lr=1e-3"], ["optim.lr=3e-4"]]
    assert varying([["strategy=ddp"]]) == [["strategy=ddp"]]  # one job: all of its overrides


def test_the_table_and_the_exit_code(tmp_path):
    outcomes = [JobOutcome(0, ["optim.lr=1e-3"], "/s/0", 0, 12.4, 5.25, 5.1, 9000.0),
                JobOutcome(1, ["optim.lr=-1"], "/s/1", 2, 3.0), JobOutcome(2, ["optim.lr=9"], "/s/2", 3, 8.0, None)]
    table = summary_table(outcomes)
    assert "| 0 | `optim.lr=1e-3` | finished | 5.2500 | 5.1000 | 9000 | 12 |" in table
    assert "| 1 | `optim.lr=-1` | failed (exit 2) | - | - | - | 3 |" in table
    assert sweep_exit_code(outcomes) == 2 and sweep_exit_code(outcomes[:1]) == 0
    write_summary(tmp_path, outcomes)
    assert json.loads((tmp_path / "summary.json").read_text())[1]["status"] == "failed (exit 2)"
    assert table in (tmp_path / "summary.md").read_text() and not list(tmp_path.glob(".*.tmp"))
