"""Finding and reading run directories (trainer/observe/report/runs.py): a run or the runs below a folder (a Hydra
sweep, a failed job included), JSONL logs with a last line cut short by a crash, and errors naming the file."""
from __future__ import annotations

import fcntl
import os

import pytest

from tests.unit.observe.report.report_files import config, records, write_run
from trainer.observe.report.runs import ReportError, find_runs, holds_lock, read_jsonl, read_runs, run_names


def test_a_last_line_cut_short_is_skipped_and_any_other_bad_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert [r["step"] for r in read_jsonl(str(path))] == [1, 2]
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl line 2 is not a JSON object with an integer step"):
        read_jsonl(str(path))
    path.write_text('{"step": 1}\n["not", "a", "record"]\n')  # complete (a newline follows): not a crash
    with pytest.raises(ReportError, match="line 2"):
        read_jsonl(str(path))
    assert read_jsonl(str(tmp_path / "absent.jsonl")) == []


def test_a_sweep_directory_stands_for_its_jobs_in_natural_order(tmp_path):
    sweep = tmp_path / "sweep"
    for job in (0, 1, 2, 10):
        write_run(sweep / str(job), metrics=records(2), config=config(), overrides=[f"optim.lr={job}"])
    write_run(sweep / "3", overrides=["optim.lr=3"])  # failed before logging: .hydra/ only
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    # a run's own folders are not searched: a moved-aside earlier run, checkpoints
    write_run(sweep / "0" / "previous-20260101-000000", metrics=records(1))
    (sweep / "0" / "checkpoints" / "step_2").mkdir(parents=True)
    write_run(sweep / ".submitit" / "x", metrics=records(1))  # hidden folders are never runs
    found = find_runs([str(sweep)])
    assert [os.path.relpath(p, sweep) for p in found] == ["0", "1", "2", "3", "10"]
    runs = read_runs(found)
    assert [r.name for r in runs] == ["0", "1", "2", "3", "10"]
    failed = runs[3]
    assert failed.metrics == [] and failed.overrides == ["optim.lr=3"] and failed.config == {}


def test_runs_given_twice_or_inside_a_given_folder_are_reported_once(tmp_path):
    a = write_run(tmp_path / "x" / "a", metrics=records(1))
    b = write_run(tmp_path / "y" / "a", metrics=records(1))
    found = find_runs([str(a), str(tmp_path), str(b)])
    assert found == [str(a), str(b)]
    assert run_names(found) == ["x/a", "y/a"]  # below their common folder: two runs named `a` stay apart
    assert run_names([str(a)]) == ["a"]


@pytest.mark.parametrize("case", ["missing", "file", "empty"])
def test_a_path_that_is_no_run_and_holds_none_is_named(tmp_path, case):
    path = tmp_path / "x"
    if case == "file":
        path.write_text("")
    elif case == "empty":
        (path / "logs").mkdir(parents=True)
    with pytest.raises(ReportError, match=str(path)):
        find_runs([str(path)])


def test_a_live_run_is_one_whose_lock_is_held(tmp_path):
    run = write_run(tmp_path / "run", metrics=records(1))
    assert not holds_lock(str(run))
    with open(run / ".lock", "w") as fh:
        assert not holds_lock(str(run))
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as rank 0 holds it for the job's life
        assert holds_lock(str(run))
    assert not holds_lock(str(run))


def test_a_run_file_that_does_not_parse_is_named(tmp_path):
    run = write_run(tmp_path / "run", metrics=records(1))
    (run / "config.yaml").write_text("train: [unclosed\n")
    with pytest.raises(ReportError, match=r"config.yaml is not valid YAML"):
        read_runs([str(run)])
    (run / "config.yaml").unlink()
    (run / "memory.json").write_text("{")
    with pytest.raises(ReportError, match=r"memory.json is not valid JSON"):
        read_runs([str(run)])
