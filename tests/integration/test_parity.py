"""Data parallelism reproduces single-process training: same loss and gradient-norm curves (fp32). World size 2
with accumulation, bf16 against fp32 and every other layout are in the architecture matrix
(tests/integration/test_architectures.py); here ws4 and fp16's skipped steps."""
from __future__ import annotations

import math

import pytest

from tests.integration.conftest import FP32_TOL, SMALL, launch, metrics, ok, rel_err

TEN_STEPS = ["train.max_steps=10", "train.log_every=1", "train.global_batch_size=8", "eval.every=0",
             "eval.at_end=false", "export.hf_at_end=false"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    # Accumulation 4 on one process: micro-batches of 2.
    ok(launch("python", SMALL + TEN_STEPS + ["strategy=single", "train.micro_batch_size=2"], run_dir))
    return metrics(run_dir)


@pytest.mark.parametrize("nproc,micro", [(4, 1)], ids=["ws4-accum2"])
def test_ddp_matches_single_process(reference, tmp_path, nproc, micro):
    proc = launch("torchrun", SMALL + TEN_STEPS + ["strategy=ddp", f"train.micro_batch_size={micro}"], tmp_path,
                  nproc=nproc)
    ok(proc)
    recs = metrics(tmp_path)
    assert len(recs) == len(reference) == 10
    loss_err = max(rel_err(r["loss"], s["loss"]) for r, s in zip(recs, reference))
    norm_err = max(rel_err(r["grad_norm"], s["grad_norm"]) for r, s in zip(recs, reference))
    print(f"ddp world {nproc}: max relative loss error {loss_err:.2e}, grad-norm error {norm_err:.2e}")
    assert loss_err < FP32_TOL and norm_err < FP32_TOL, (loss_err, norm_err)
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.5  # it really trained


FP16_OVERFLOWING = ["precision=fp16", "precision.init_scale=16777216", "train.max_steps=30", "train.log_every=1",
                    "train.global_batch_size=4", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false"]


def test_fp16_overflow_steps_are_skipped_and_counted(tmp_path):
    # A loss scale of 2^24 overflows fp16 gradients: those steps are skipped and the scale backs off.
    ok(launch("python", SMALL + FP16_OVERFLOWING + ["strategy=single", "train.micro_batch_size=4"], tmp_path))
    recs = metrics(tmp_path)
    skipped = recs[-1]["skipped_steps"]
    # 2^24 backs off by halving on each overflow until the gradients fit: several skips, then none.
    assert 1 <= skipped <= 15, skipped
    assert recs[-1]["loss_scale"] < 16777216
    assert [r["skipped_steps"] for r in recs] == sorted(r["skipped_steps"] for r in recs)
    assert recs[-1]["loss"] < recs[skipped]["loss"]  # training went on after the skips


def test_fp16_overflow_on_every_shard_skips_the_step_under_fsdp(tmp_path):
    """FSDP's scaler agrees the overflow over the ranks; torch's fused AdamW skips its update only for a found-inf
    flag of exactly 1 (the ranks' sum, 2, stepped on the non-finite gradients: every weight NaN from step 1). The
    fused kernel's run is the foreach kernel's: the same skipped steps and scales, the same curve."""
    runs = {}
    for kernel in ("fused", "foreach"):
        overrides = ["strategy=fsdp", "train.micro_batch_size=2", f"optim.implementation={kernel}"]
        ok(launch("torchrun", SMALL + FP16_OVERFLOWING + overrides, tmp_path / kernel, nproc=2))
        runs[kernel] = metrics(tmp_path / kernel)
    fused, foreach = runs["fused"], runs["foreach"]
    losses = [r["loss"] for r in fused]
    assert len(fused) == 30 and all(x is not None and math.isfinite(x) for x in losses), losses
    skipped = fused[-1]["skipped_steps"]
    assert 1 <= skipped <= 15 and fused[-1]["loss"] < fused[skipped]["loss"], fused[-1]
    assert [(r["skipped_steps"], r["loss_scale"]) for r in fused] == \
        [(r["skipped_steps"], r["loss_scale"]) for r in foreach]
    loss_err = max(rel_err(r["loss"], s["loss"]) for r, s in zip(fused, foreach))
    print(f"fsdp ws2 fp16, fused vs foreach AdamW: {skipped} skipped steps each, loss {loss_err:.1e}")
    assert loss_err < FP32_TOL * 10, loss_err
