"""The report's figures (trainer/observe/report/plots.py): valid PNGs of every quantity some run has, the others
skipped (and an earlier report's copy removed), written whole."""
from __future__ import annotations

import os

from matplotlib.image import imread

from tests.unit.observe.report.report_files import config, memory, records, write_run
from trainer.observe.report.plots import write_plots
from trainer.observe.report.runs import read_runs

ALWAYS = ["train_loss_by_step.png", "train_loss_by_tokens.png", "tokens_per_s_by_step.png",
          "peak_memory_by_step.png"]


def _check_png(path) -> None:
    assert os.path.getsize(path) > 0
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.shape[2] in (3, 4)


def test_every_quantity_a_run_has_is_drawn(tmp_path):
    mixed = records(4, comm_bytes=1_000_000)
    for r in mixed:
        r["tasks"] = {"plays": {"loss": r["loss"] + 0.1, "tokens": 300}, "alpaca": {"loss": None, "tokens": 0}}
    evals = [{"step": s, "val_loss": 4.0 - 0.1 * s, "val_loss_by_task": {"plays": 4.1, "alpaca": 3.9}}
             for s in (0, 2, 4)]
    a = write_run(tmp_path / "a", metrics=mixed, evals=evals, config=config(), memory=memory(2_000_000))
    b = write_run(tmp_path / "b", metrics=records(4, lr=1e-2), config=config(lr=1e-2))
    out = tmp_path / "report"
    out.mkdir()
    written, skipped = write_plots(read_runs([str(a), str(b)]), str(out))
    assert skipped == []
    files = sorted(p.file for p in written)
    assert files == sorted(ALWAYS + ["val_loss_by_step.png", "val_loss_by_tokens.png", "task_loss_by_step.png",
                                     "comm_bytes_by_step.png", "model_states.png"])
    for name in files:
        _check_png(out / name)
    assert sorted(os.listdir(out)) == files  # no temporary file left behind


def test_a_quantity_no_run_has_is_skipped_and_an_old_copy_removed(tmp_path):
    run = write_run(tmp_path / "run", metrics=records(3), config=config())
    out = tmp_path / "report"
    out.mkdir()
    (out / "comm_bytes_by_step.png").write_bytes(b"an earlier report's figure")
    (out / "notes.txt").write_text("kept")
    written, skipped = write_plots(read_runs([str(run)]), str(out))
    assert [p.file for p in written] == ALWAYS
    assert {p.file: p.missing for p in skipped} == {
        "val_loss_by_step.png": "no run was evaluated (eval.every, eval.at_end)",
        "val_loss_by_tokens.png": "no run was evaluated (eval.every, eval.at_end)",
        "task_loss_by_step.png": "no run logged per-task losses (data=mixture)",
        "comm_bytes_by_step.png": "no run logged comm_bytes (logging.comm_bytes=true)",
        "model_states.png": "no run has memory.json (logging.memory_report=true)"}
    assert sorted(os.listdir(out)) == sorted(ALWAYS + ["notes.txt"])


def test_a_run_that_logged_nothing_draws_nothing(tmp_path):
    failed = write_run(tmp_path / "failed", overrides=["optim.lr=1"])
    out = tmp_path / "report"
    out.mkdir()
    written, skipped = write_plots(read_runs([str(failed)]), str(out))
    assert written == [] and len(skipped) == 9 and os.listdir(out) == []
