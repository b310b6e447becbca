"""End-to-end runs through all three launchers: same losses, one run directory, full outputs."""
from __future__ import annotations

import os

import pytest
import torch

from tests.integration.conftest import FP32_TOL, SMALL, launch, metrics, ok, rel_err

STEPS = ["train.max_steps=6", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2",
         "eval.every=3", "scheduler.warmup_steps=2"]
REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "skipped_steps", "peak_mem_gib", "time"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("launchers")
    out = {}
    for launcher, nproc, strategy in (("python", 1, "single"), ("torchrun", 2, "ddp"), ("deepspeed", 2, "ddp")):
        run_dir = base / launcher
        proc = launch(launcher, SMALL + STEPS + [f"strategy={strategy}"], run_dir, nproc=nproc)
        out[launcher] = (proc, run_dir)
    return out


@pytest.mark.parametrize("launcher", ["python", "torchrun", "deepspeed"])
def test_launcher_trains_and_writes_outputs(runs, launcher):
    proc, run_dir = runs[launcher]
    ok(proc)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == list(range(1, 7))
    for r in recs:
        assert REQUIRED <= set(r), set(r)
    assert recs[-1]["tokens"] == 6 * 8 * 32  # 6 steps x 8 sequences x 32 target tokens
    # Wall-clock time of each logged step (Unix seconds): in order, after the run wrote its config and before
    # metrics.jsonl was last written.
    times = [r["time"] for r in recs]
    written = ((run_dir / "config.yaml").stat().st_mtime, (run_dir / "metrics.jsonl").stat().st_mtime)
    assert times == sorted(times) and written[0] - 0.01 <= times[0] and times[-1] <= written[1] + 0.01, \
        (times, written)
    assert "val_loss" in recs[2] and "val_loss" in recs[5]
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "hf" / "model.safetensors").is_file()
    # Every rank used the one run directory: nothing else was created next to it.
    assert sorted(p.name for p in run_dir.parent.iterdir()) == sorted(runs)


def test_launchers_agree_on_losses(runs):
    curves = {name: [r["loss"] for r in metrics(run_dir)] for name, (proc, run_dir) in runs.items()
              if proc.returncode == 0}
    assert len(curves) == 3
    ref = curves["python"]
    for name, curve in curves.items():
        assert len(curve) == len(ref) == 6
        assert max(rel_err(a, b) for a, b in zip(curve, ref)) < FP32_TOL, (name, curve, ref)
    assert ref[-1] < ref[0] - 0.1, ref  # it trained (6 steps, 2 of them warmup)


def test_hf_export_loads(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run_dir = runs["torchrun"]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    tok = AutoTokenizer.from_pretrained(run_dir / "hf")
    ids = torch.tensor([tok("Mia had a red ball.")["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert tok.decode(ids[0], skip_special_tokens=True) == "Mia had a red ball."  # the run's tokenizer, exported


def test_launch_sh_runs_default_with_overrides(tmp_path):
    from tests.integration.conftest import REPO, run_process_group

    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1",
               TESSERA_VENV=os.path.dirname(os.path.dirname(__import__("sys").executable)))
    proc = run_process_group([str(REPO / "launch.sh")] + SMALL + ["train.max_steps=3", "eval.every=0",
                                                          f"hydra.run.dir={tmp_path / 'run'}"], env=env)
    ok(proc)
    recs = metrics(tmp_path / "run")
    assert recs[-1]["step"] == 3
    assert "world 2" in proc.stdout + proc.stderr  # launch.sh chose torchrun with 2 processes for ddp
