"""`python -m trainer.report` on real runs: two short single-process runs through the real entry point that differ
in optim.lr, reported together; the table's rows are the runs' last metrics, optim.lr the one differing override,
and every figure it links is a PNG."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from matplotlib.image import imread

from tests.integration.conftest import REPO, SMALL, launch, metrics, ok, read_jsonl
from tests.unit.observe.report.report_files import table_rows
from trainer.observe.report.markdown import loss, rate, size

BASE = SMALL + ["strategy=single", "train.max_steps=4", "train.log_every=1", "train.global_batch_size=8",
                "train.micro_batch_size=4", "eval.every=0", "eval.at_end=true", "eval.max_sequences=8",
                "export.hf_at_end=false", "checkpoint.at_end=false"]
LRS = {"slow": "0.0005", "fast": "0.01"}


def test_two_runs_that_differ_in_lr(tmp_path):
    def train(name):
        ok(launch("python", BASE + [f"optim.lr={LRS[name]}"], tmp_path / "runs" / name, timeout=240))

    with ThreadPoolExecutor(2) as pool:  # mostly start-up time
        list(pool.map(train, LRS))
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "trainer.report", *(str(tmp_path / "runs" / n) for n in LRS),
                           "--out", str(out)], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = (out / "report.md").read_text()
    print(text)
    rows = table_rows(text)
    assert [r["run"] for r in rows] == list(LRS)
    columns = list(rows[0])
    assert columns[1:columns.index("exit")] == ["optim.lr"]  # the one override that differs
    for row, name in zip(rows, LRS):
        recs = metrics(tmp_path / "runs" / name)
        last, evals = recs[-1], read_jsonl(tmp_path / "runs" / name / "eval.jsonl")
        assert row["optim.lr"] == LRS[name] and row["exit"] == "finished"
        assert (row["steps"], row["tokens"]) == ("4", str(last["tokens"]))
        assert row["final loss"] == loss(last["loss"])
        assert row["last val loss"] == row["best val loss"] == loss(evals[-1]["val_loss"])
        assert row["median tokens/s"] == rate(statistics.median(r["tokens_per_s"] for r in recs))
        assert row["peak memory"] == size(max(r["peak_mem_gib"] for r in recs) * 2**30)
    for png in ("train_loss_by_step.png", "train_loss_by_tokens.png", "val_loss_by_step.png",
                "val_loss_by_tokens.png", "tokens_per_s_by_step.png", "peak_memory_by_step.png"):
        assert f"]({png})" in text
        assert imread(out / png).shape[2] in (3, 4)
    assert "- `comm_bytes_by_step.png`:" in text and not (out / "comm_bytes_by_step.png").exists()
