"""export.snapshot_every: a model that serves while it trains. A reader that keeps loading snapshots/current with
from_pretrained while the run writes a snapshot every step never gets an incomplete model; the last
export.snapshot_keep snapshots remain; sharded strategies write them too (real processes)."""
from __future__ import annotations

import os
import subprocess
import time

import torch

from tests.integration.conftest import SMALL, launch, ok
from trainer.launch.choose import launcher_command

QUIET = ["eval.every=0", "eval.at_end=false", "checkpoint.at_end=false", "train.log_every=10"]


def test_a_reader_of_current_always_loads_a_complete_model(tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    # a model and batch large enough that the steps and snapshots take about as long as a load
    cmd = launcher_command("python", 1) + SMALL + QUIET + [
        "model.hidden_size=128", "model.num_layers=4", "train.global_batch_size=16", "train.micro_batch_size=16",
        "strategy=single", "train.max_steps=40", "export.snapshot_every=1", "export.snapshot_keep=2",
        "export.hf_at_end=true", f"hydra.run.dir={run}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    current = run / "snapshots" / "current"
    loaded, loads, failures, deadline = set(), 0, [], time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if not os.path.lexists(current):
            time.sleep(0.05)
            continue
        try:
            target = os.readlink(current)
            model = AutoModelForCausalLM.from_pretrained(current)
            assert all(torch.isfinite(p).all() for p in model.parameters())
            loaded.add(target)
            loads += 1
        except Exception as e:  # noqa: BLE001 - any failure to load is what this test looks for
            failures.append(f"{type(e).__name__}: {e}")
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output[-3000:]
    print(f"the reader loaded current {loads} times ({len(loaded)} different snapshots) while training ran; "
          f"failures: {len(failures)}")
    assert failures == [] and loads >= 5 and len(loaded) >= 3
    assert os.readlink(current) == "step_40"
    assert sorted(p.name for p in (run / "snapshots").iterdir()) == ["current", "step_39", "step_40"]
    # the last snapshot is the final model
    from safetensors.torch import load_file

    last, final = load_file(run / "snapshots" / "step_40" / "model.safetensors"), load_file(run / "hf" / "model.safetensors")
    assert last.keys() == final.keys() and all(torch.equal(last[k], final[k]) for k in last)


def test_sharded_strategies_write_snapshots(tmp_path):
    ok(launch("torchrun", SMALL + QUIET + ["strategy=fsdp", "train.max_steps=4", "export.snapshot_every=2",
                                           "export.hf_at_end=false"], tmp_path, nproc=2))
    from transformers import AutoModelForCausalLM

    assert os.readlink(tmp_path / "snapshots" / "current") == "step_4"
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["current", "step_2", "step_4"]
    AutoModelForCausalLM.from_pretrained(tmp_path / "snapshots" / "current")
