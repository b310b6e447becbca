"""`python -m trainer.report` (trainer/observe/report/command.py): report.md's rows against the runs' files, its
links to the figures, the default report folder, a sweep with a failed job, and one-line exits 2 on bad input."""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.unit.observe.report.report_files import (config, memory, records, table_rows,
                                                     write_run)
from trainer.observe.report.command import default_out, main
from trainer.observe.report.markdown import loss, rate, size


def test_the_table_holds_each_runs_numbers_and_links_the_figures(tmp_path, capsys):
    fast = records(6, lr=1e-3)
    slow = records(4, lr=1e-2, loss0=6.0)
    evals = [{"step": 3, "val_loss": 4.2}, {"step": 6, "val_loss": 4.4}]
    a = write_run(tmp_path / "runs" / "a", metrics=fast, evals=evals, config=config(max_steps=6, lr=1e-3),
                  overrides=["optim.lr=0.001", "train.max_steps=6"], memory=memory(3 * 2**20))
    b = write_run(tmp_path / "runs" / "b", metrics=slow, config=config(max_steps=6, lr=1e-2),
                  overrides=["optim.lr=0.01", "train.max_steps=6"])
    assert main([str(a), str(b)]) == 0
    out = tmp_path / "runs" / "report"  # several runs: report/ in their common folder
    text = (out / "report.md").read_text()
    assert "| run | `optim.lr` | exit |" in text  # the one override that differs
    rows = table_rows(text)
    assert [r["run"] for r in rows] == ["a", "b"]
    for row, metrics in zip(rows, (fast, slow)):
        assert row["steps"] == str(metrics[-1]["step"]) and row["tokens"] == str(metrics[-1]["tokens"])
        assert row["final loss"] == loss(metrics[-1]["loss"])
        assert row["median tokens/s"] == rate(statistics.median(r["tokens_per_s"] for r in metrics))
        assert row["peak memory"] == size(max(r["peak_mem_gib"] for r in metrics) * 2**30)
    assert [r["optim.lr"] for r in rows] == ["0.001", "0.01"]
    assert (rows[0]["last val loss"], rows[0]["best val loss"], rows[1]["last val loss"]) == ("4.4000", "4.2000", "-")
    assert (rows[0]["model states"], rows[1]["model states"]) == ("3.00 MiB", "-")
    assert (rows[0]["exit"], rows[1]["exit"]) == ("finished", "stopped at step 4")
    for png in re.findall(r"\]\(([\w.]+\.png)\)", text):
        assert (out / png).stat().st_size > 0
    assert "- `comm_bytes_by_step.png`: no run logged comm_bytes" in text
    assert str(out / "report.md") in capsys.readouterr().out


def test_a_sweep_directory_with_a_failed_job(tmp_path):
    sweep = tmp_path / "sweep"
    for job, lr in enumerate(("0.001", "0.01")):
        write_run(sweep / str(job), metrics=records(4), config=config(lr=float(lr)), overrides=[f"optim.lr={lr}"])
    write_run(sweep / "2", overrides=["optim.lr=0.1"])  # failed before its first log
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    assert main([str(sweep)]) == 0
    rows = table_rows((sweep / "report" / "report.md").read_text())
    assert [(r["run"], r["optim.lr"]) for r in rows] == [("0", "0.001"), ("1", "0.01"), ("2", "0.1")]
    failed = rows[2]
    assert failed["exit"] == "failed: nothing logged"
    assert all(failed[c] == "-" for c in ("steps", "tokens", "final loss", "median tokens/s", "peak memory"))
    assert main([str(sweep)]) == 0  # again: its own report/ folder is no run


def test_the_default_report_folder(tmp_path):
    assert default_out([str(tmp_path / "run")]) == str(tmp_path / "run" / "report")
    assert default_out([str(tmp_path / "x" / "a"), str(tmp_path / "y")]) == str(tmp_path / "report")


def _report(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TESSERA_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "trainer.report", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def _bad_metrics(tmp_path):
    run = write_run(tmp_path / "run", config=config())
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n{"step": 2, "loss": 1.0}\n')
    return run / "metrics.jsonl", run


@pytest.mark.parametrize("case", ["missing", "no runs", "bad metrics"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
    if case == "missing":
        named = given = tmp_path / "nope"
    elif case == "no runs":
        named = given = tmp_path / "empty"
        (given / "notes").mkdir(parents=True)
    else:
        named, given = _bad_metrics(tmp_path)
    proc = _report(given)
    assert proc.returncode == 2, proc
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert str(named) in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "report").exists() and not (given / "report").exists()
