"""Fixed-seed fp32 runs log the numbers recorded in tests/integration/pinned/fixed_seed_fp32.json: every step's
loss and gradient norm and the validation losses, relative difference at most 1e-6. A change that does not mean to
change numbers (a refactor, a speed-up) keeps this green; one that does rewrites the file on purpose:

    TESSERA_PIN_WRITE=1 pytest tests/integration/test_pinned_numbers.py

The file holds six layouts (single, ddp, zero2, fsdp, tp, pp); the default run checks four of them, one per
launcher and step shape (python, deepspeed, torchrun with sharding, the pipeline schedule). ddp and tp run with
TESSERA_PIN_ALL=1."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.integration.conftest import FP32_TOL, SMALL, launch, ok, read_jsonl, rel_err

PINNED = Path(__file__).parent / "pinned" / "fixed_seed_fp32.json"
RUN = SMALL + ["train.max_steps=6", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2",
               "train.seed=1234", "eval.every=3", "eval.max_sequences=16", "eval.at_end=true",
               "export.hf_at_end=false", "checkpoint.at_end=false", "precision=fp32"]
LAYOUTS = {  # name -> (launcher, processes, overrides)
    "single": ("python", 1, ["strategy=single"]),
    "ddp": ("torchrun", 2, ["strategy=ddp"]),
    "zero2": ("deepspeed", 2, ["strategy=zero2"]),
    "fsdp": ("torchrun", 2, ["strategy=fsdp"]),
    "tp": ("torchrun", 2, ["strategy=tp"]),
    "pp": ("torchrun", 2, ["strategy=pp", "strategy.pp_schedule=1f1b"]),
}
DEFAULT = ["single", "zero2", "fsdp", "pp"]
CHECKED = list(LAYOUTS) if os.environ.get("TESSERA_PIN_ALL") or os.environ.get("TESSERA_PIN_WRITE") else DEFAULT


def numbers(run_dir: Path) -> dict:
    """What the run logged: per-step loss and grad norm, and each evaluation's validation loss."""
    steps = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    return {"loss": [r["loss"] for r in steps], "grad_norm": [r["grad_norm"] for r in steps],
            "val_loss": [r["val_loss"] for r in evals], "eval_steps": [r["step"] for r in evals]}


@pytest.mark.parametrize("layout", CHECKED)
def test_fixed_seed_numbers_are_pinned(layout, tmp_path):
    launcher, nproc, extra = LAYOUTS[layout]
    ok(launch(launcher, RUN + extra, tmp_path, nproc=nproc))
    got = numbers(tmp_path)
    if os.environ.get("TESSERA_PIN_WRITE"):
        pinned = json.loads(PINNED.read_text()) if PINNED.exists() else {}
        pinned[layout] = got
        PINNED.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"wrote {layout} into {PINNED.name}")
    want = json.loads(PINNED.read_text())[layout]
    assert got["eval_steps"] == want["eval_steps"] and len(got["loss"]) == len(want["loss"]) == 6
    worst = {key: max(rel_err(a, b) for a, b in zip(got[key], want[key])) for key in ("loss", "grad_norm", "val_loss")}
    print(f"{layout}: worst relative difference to the pinned numbers {worst}")
    assert all(err <= FP32_TOL for err in worst.values()), (worst, got, want)
