"""Each run's figures for the report's table against its files, how a run ended, and the overrides that differ
between runs (trainer/observe/report/summary.py)."""
from __future__ import annotations

import fcntl
import math
import statistics

from tests.unit.observe.report.report_files import config, memory, records, write_run
from trainer.observe.report.runs import read_runs
from trainer.observe.report.summary import differing_overrides, summarize


def _one(path):
    return read_runs([str(path)])[0]


def test_the_figures_are_those_of_the_files(tmp_path):
    metrics = records(6)
    evals = [{"step": 0, "val_loss": 5.5, "val_ppl": 245.0}, {"step": 3, "val_loss": 4.1, "val_ppl": 60.0},
             {"step": 6, "val_loss": 4.3, "val_ppl": 73.0}]
    s = summarize(_one(write_run(tmp_path / "run", metrics=metrics, evals=evals, config=config(max_steps=6),
                                 memory=memory(3_000_000, 5_000_000))))
    assert (s.steps, s.tokens, s.final_loss) == (6, metrics[-1]["tokens"], metrics[-1]["loss"])
    assert (s.last_val, s.best_val) == (4.3, 4.1)
    assert s.median_tokens_per_s == statistics.median(r["tokens_per_s"] for r in metrics)
    assert s.peak_mem_gib == max(r["peak_mem_gib"] for r in metrics)
    assert s.model_states_bytes == 5_000_000  # the largest rank
    assert s.state == "finished"


def test_validation_from_the_metrics_when_there_is_no_eval_log(tmp_path):
    metrics = records(4)
    metrics[1]["val_loss"], metrics[3]["val_loss"] = 3.0, 3.5
    s = summarize(_one(write_run(tmp_path / "run", metrics=metrics)))
    assert (s.last_val, s.best_val, s.model_states_bytes, s.state) == (3.5, 3.0, None, "stopped at step 4")


def test_how_a_run_ended(tmp_path):
    done = write_run(tmp_path / "done", metrics=records(4), config=config(max_steps=4))
    (done / "hf").mkdir()
    (done / "hf" / "config.json").write_text("{}")
    for name, complete in (("step_2", True), ("step_4", True), ("step_6", False)):
        (done / "checkpoints" / name).mkdir(parents=True)
        if complete:
            (done / "checkpoints" / name / "COMPLETE.json").write_text("{}")
    (done / "checkpoints" / "latest").write_text("step_4")
    assert summarize(_one(done)).state == "finished, checkpoint step_4, hf/"

    stopped = write_run(tmp_path / "stopped", metrics=records(3), config=config(max_steps=10))
    assert summarize(_one(stopped)).state == "stopped at step 3"

    diverged = records(3)
    diverged[-1]["loss"] = None  # a non-finite loss, as the trainer writes it
    s = summarize(_one(write_run(tmp_path / "diverged", metrics=diverged, config=config(max_steps=10))))
    assert s.state == "diverged at step 3" and math.isnan(s.final_loss)

    failed = summarize(_one(write_run(tmp_path / "failed", overrides=["optim.lr=1"])))
    assert failed.state == "failed: nothing logged"
    assert (failed.steps, failed.final_loss, failed.median_tokens_per_s, failed.peak_mem_gib) == (None,) * 4

    live = write_run(tmp_path / "live", metrics=records(2), config=config(max_steps=10))
    with open(live / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert summarize(_one(live)).state == "running"


def test_the_overrides_that_differ(tmp_path):
    common = ["model.hidden_size=64", "hydra.job.chdir=false"]
    a = write_run(tmp_path / "a", metrics=records(1), config=config(lr=1e-3),
                  overrides=common + ["export.hf_at_end=false"])
    b = write_run(tmp_path / "b", metrics=records(1), config=config(lr=1e-2, strategy="ddp"),
                  overrides=common + ["optim.lr=1e-2", "export.hf_at_end=False", "strategy=ddp", "+extra.key=1"])
    keys, values = differing_overrides(read_runs([str(a), str(b)]))
    # hydra.* and equal values (`false` and `False`) left out; a run without the override shows its config's value,
    # a config group its option's name
    assert keys == ["optim.lr", "strategy", "extra.key"]
    assert values == [{"optim.lr": "0.001", "strategy": "single", "extra.key": "-"},
                      {"optim.lr": "1e-2", "strategy": "ddp", "extra.key": "1"}]


def test_runs_without_hydra_overrides_differ_by_their_configs(tmp_path):
    a = write_run(tmp_path / "a", metrics=records(1), config=config(lr=1e-3))
    b = write_run(tmp_path / "b", metrics=records(1), config=config(lr=3e-3))
    keys, values = differing_overrides(read_runs([str(a), str(b)]))
    assert keys == ["optim.lr"] and values == [{"optim.lr": "0.001"}, {"optim.lr": "0.003"}]
    assert differing_overrides(read_runs([str(a)])) == ([], [{}])
