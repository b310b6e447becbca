"""data=tokens end to end: a corpus tokenized by `python -m trainer.tokenize` (2 workers, several shards) trains
through the real launchers; two ranks give the one-process curve (fp32), and a run resumed from a checkpoint
continues it exactly (the batch order is a function of the step, also over a store)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.conftest import FP32_TOL, REPO, SMALL, curve_errors, launch, metrics, ok

RUN = [o for o in SMALL if not o.startswith("data.")] + [
    "data=tokens", "data.seq_len=32", "train.max_steps=6", "train.log_every=1", "train.global_batch_size=8",
    "train.micro_batch_size=2", "eval.every=3", "eval.max_sequences=8", "export.hf_at_end=false",
    "checkpoint.every=3", "checkpoint.keep_last=0", "checkpoint.at_end=false"]


@pytest.fixture(scope="module")
def store(generated_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("store") / "corpus"
    proc = subprocess.run([sys.executable, "-m", "trainer.tokenize", str(out), "--workers", "2", "--shard-bytes",
                           "20000", "data=text", f"data.path={generated_data.text}"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    ok(proc)
    assert "token store" in proc.stdout and (out / "manifest.json").is_file()
    return out


@pytest.fixture(scope="module")
def single(store, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    proc = launch("python", RUN + [f"data.path={store}", "strategy=single"], run_dir)
    ok(proc)
    assert "token store (text, " in proc.stdout + proc.stderr
    return run_dir


def test_two_ranks_train_the_one_process_curve_from_a_store(store, single, tmp_path):
    ok(launch("torchrun", RUN + [f"data.path={store}", "strategy=ddp"], tmp_path, nproc=2))
    loss_err, norm_err = curve_errors(metrics(tmp_path), metrics(single), same_steps=True)
    print(f"data=tokens ddp ws2 vs one process: loss {loss_err:.2e}, grad norm {norm_err:.2e}")
    assert loss_err < FP32_TOL and norm_err < FP32_TOL


def test_a_resumed_run_continues_exactly(store, single, tmp_path):
    proc = launch("python", RUN + [f"data.path={store}", "strategy=single",
                                   f"checkpoint.resume={single / 'checkpoints' / 'step_3'}"], tmp_path)
    ok(proc)
    a = {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics(single)}
    b = {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics(tmp_path)}
    assert sorted(b) == [4, 5, 6] and all(b[s] == a[s] for s in b), (a, b)
