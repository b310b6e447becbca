"""`python -m trainer.parity` end to end on the debug-size model (4 launches): one process against DDP on 2 ranks
agrees to fp32 precision, and a bf16 side differs from fp32 by more than fp32 rounding but within bf16's tolerance."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.integration.conftest import REPO, SMALL

BATCH = SMALL + ["train.global_batch_size=8", "train.micro_batch_size=2"]


def parity(args, out, timeout: float = 600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "trainer.parity", *args, "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    print(proc.stdout)
    return proc


def test_single_process_and_ddp_agree_in_fp32(tmp_path):
    proc = parity(BATCH + ["strategy=single", "--against", "strategy=ddp", "--against-nproc", "2", "--steps", "4"],
                  tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "parity.json").read_text())
    assert data["passed"] and data["tolerance"] == 1e-5
    assert (data["a"]["launcher"], data["b"]["launcher"], data["b"]["nproc"]) == ("python", "torchrun", 2)
    assert [s["step"] for s in data["steps"]] == [1, 2, 3, 4]
    assert data["max_loss_rel_diff"] < 1e-5 and data["max_grad_norm_rel_diff"] < 1e-5, data
    assert "parity PASS" in proc.stdout and "rel diff" in proc.stdout
    for name in ("parity.md", "parity.png", "a/metrics.jsonl", "b/metrics.jsonl"):
        assert (tmp_path / name).is_file(), name
    assert not (tmp_path / "a" / "checkpoints").exists() and not (tmp_path / "a" / "hf").exists()  # cheap runs


def test_bf16_differs_from_fp32_within_the_bf16_tolerance(tmp_path):
    proc = parity(BATCH + ["strategy=single", "--against", "precision=bf16", "--steps", "4"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "parity.json").read_text())
    assert data["tolerance"] == 3e-2 and data["b"]["precision"] == "bf16"
    # bf16 really ran (fp32 layouts differ by ~1e-7), and stays within its tolerance
    assert 1e-5 < max(data["max_loss_rel_diff"], data["max_grad_norm_rel_diff"]) < 3e-2, data
