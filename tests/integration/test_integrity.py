"""Nothing is lost or silently wrong: checksummed checkpoints (bit flips found, resume=auto falls back to the newest
intact one), the divergence guard (stop after the last finite checkpoint, never export NaNs, or skip the step), and
the resume policy for config values that differ from the checkpoint's (applied and reported, or refused)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.catalogue import Timer, check_case
from tests.integration.conftest import REPO, SMALL, launch, metrics, ok

BASE = SMALL + ["strategy=single", "data.embedded_documents=40", "train.global_batch_size=4",
                "train.micro_batch_size=2", "train.log_every=1", "eval.every=0", "eval.at_end=false",
                "export.hf_at_end=false", "train.max_steps=8", "checkpoint.keep_last=0"]


def _curve(run_dir, key="loss"):
    return {r["step"]: r[key] for r in metrics(run_dir)}


def _strict_json_lines(path):
    """Every line parses as strict JSON (no NaN / Infinity literals)."""
    def refuse(constant):
        raise ValueError(f"{path}: bare {constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in Path(path).read_text().splitlines() if line.strip()]


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 steps with checkpoints at 2, 4, 6 and 8."""
    run_dir = tmp_path_factory.mktemp("straight")
    ok(launch("python", BASE + ["checkpoint.every=2"], run_dir))
    return run_dir


def test_bit_flip_is_found_and_auto_falls_back_to_the_newest_intact_checkpoint(straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    shutil.rmtree(run / "checkpoints" / "step_8")
    step6 = run / "checkpoints" / "step_6"
    shard = next(step6.glob("*.distcp"))
    _flip_a_byte(shard)  # same size: only the checksum can tell
    # An explicit resume of the damaged checkpoint and its export are refused, naming the file.
    with Timer() as t:
        proc = launch("python", BASE + [f"checkpoint.resume={step6}"], tmp_path / "explicit")
    check_case("checkpoint: bit flip in a tensor shard (resume)", proc, t.seconds, 2, shard.name)
    with Timer() as t:
        proc = subprocess.run([sys.executable, "-m", "trainer.export", str(step6), str(tmp_path / "out")],
                              cwd=REPO, capture_output=True, text=True, timeout=180)
    check_case("checkpoint: bit flip in a tensor shard (export)", proc, t.seconds, 2, shard.name)
    assert not (tmp_path / "out").exists()
    # Metrics of steps 5..8 that the "crashed" attempt logged after step 4 will be replaced by the resumed run.
    with Timer() as t:
        proc = launch("python", BASE + ["checkpoint.every=2", "checkpoint.resume=auto"], run)
    ok(proc)
    out = proc.stdout + proc.stderr
    assert f"skipping checkpoint {step6}" in out and shard.name in out, out[-3000:]
    assert "resumed from" in out and "step_4 at step 4" in out, out[-3000:]
    got, ref = _curve(run), _curve(straight)
    assert [got[s] for s in range(5, 9)] == [ref[s] for s in range(5, 9)]  # bit-exact from the fallback
    print(f"fallback resume took {t.seconds:.1f}s")


def test_checksum_covers_every_file_of_the_checkpoint(straight):
    step2 = straight / "checkpoints" / "step_2"
    complete = json.loads((step2 / "COMPLETE.json").read_text())
    assert set(complete["sha256"]) == set(complete["files"])
    files_on_disk = {str(p.relative_to(step2)) for p in step2.rglob("*") if p.is_file()} - {"COMPLETE.json"}
    assert set(complete["files"]) == files_on_disk
    import hashlib

    for rel, digest in complete["sha256"].items():
        assert hashlib.sha256((step2 / rel).read_bytes()).hexdigest() == digest


def test_divergence_stops_after_the_last_finite_checkpoint(tmp_path):
    run = tmp_path / "run"
    with Timer() as t:
        proc = launch("python", BASE + ["train.max_steps=40", "checkpoint.every=2", "checkpoint.keep_last=1",
                                        "optim.lr=1e4", "train.grad_clip=0", "export.hf_at_end=true"], run)
    check_case("divergence: optim.lr=1e4, no clipping", proc, t.seconds, 3, "training diverged at step")
    out = proc.stdout + proc.stderr
    records = _strict_json_lines(run / "metrics.jsonl")  # valid JSON even with NaN values
    bad_step = records[-1]["step"]
    assert records[-1]["grad_norm"] is None or records[-1]["loss"] is None
    kept = sorted((run / "checkpoints").glob("step_*"))
    assert len(kept) == 1 and (kept[0] / "KEEP.json").is_file(), kept
    assert int(kept[0].name.split("_")[1]) < bad_step
    assert str(kept[0]) in out
    assert not (run / "hf").exists()  # never exported
    # The kept checkpoint holds finite weights: it exports.
    proc = subprocess.run([sys.executable, "-m", "trainer.export", str(kept[0]), str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    ok(proc)
    # A later run from it with a sane lr keeps the pinned checkpoint through keep_last rotation.
    ok(launch("python", BASE + ["train.max_steps=12", "checkpoint.every=2", "checkpoint.keep_last=1",
                                "optim.lr=1e-3", "checkpoint.resume=auto"], run))
    names = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert kept[0].name in names and "step_12" in names and len(names) == 2, names


def test_loss_spike_stops_and_skip_mode_trains_through(tmp_path):
    with Timer() as t:
        # SGD with a learning rate ramping up by 0.67 a step: five steady losses (the spike check's history), then
        # the loss blows up (measured: 765 at step 6 against a mean of 10.7). The AdamW rate of 3 used before jumped
        # at step 2 on a fresh install (5.5 -> 95.8), before five losses were logged: the check never judged it.
        proc = launch("python", BASE + ["train.max_steps=12", "optim=sgd", "optim.lr=20", "scheduler.name=constant",
                                        "scheduler.warmup_steps=30", "train.grad_clip=0",
                                        "train.loss_spike_factor=2"], tmp_path / "spike")
    check_case("divergence: loss spike over train.loss_spike_factor", proc, t.seconds, 3, "train.loss_spike_factor=2")
    # skip: steps with a non-finite gradient are not applied; the run ends normally with finite weights.
    run = tmp_path / "skip"
    proc = launch("python", BASE + ["train.max_steps=12", "optim.lr=1e4", "train.grad_clip=0",
                                    "train.on_nonfinite=skip", "export.hf_at_end=true"], run)
    ok(proc)
    records = _strict_json_lines(run / "metrics.jsonl")
    assert records[-1]["skipped_steps"] > 0
    assert "step skipped (train.on_nonfinite=skip)" in proc.stderr
    from transformers import AutoModelForCausalLM
    import torch

    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_export_refuses_non_finite_weights(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from tessera.errors import DivergenceError
    from trainer.exporting.hf_folder import write_hf_folder

    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2))
    with torch.no_grad():
        model.model.norm.weight[3] = float("nan")
    with pytest.raises(DivergenceError, match="model.norm.weight"):
        write_hf_folder(model, AutoTokenizer, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_resume_applies_a_new_learning_rate_and_refuses_a_new_seed(straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    for name in ("step_6", "step_8"):
        shutil.rmtree(run / "checkpoints" / name)
    proc = launch("python", BASE + ["checkpoint.every=2", "checkpoint.resume=auto", "optim.lr=5e-4",
                                    "optim.weight_decay=0.01"], run)
    ok(proc)
    out = proc.stdout + proc.stderr
    assert "resume: optim.lr: 0.001 -> 0.0005" in out and "optim.weight_decay: 0.1 -> 0.01" in out, out[-3000:]
    lr_before, lr_after = _curve(straight, "lr"), _curve(run, "lr")
    for step in range(5, 9):
        assert lr_after[step] == pytest.approx(lr_before[step] * 0.5, rel=1e-12)  # same schedule, new peak
    assert "lr: 0.0005" in (run / "config.yaml").read_text()  # the run's config records what was used

    step4 = straight / "checkpoints" / "step_4"
    with Timer() as t:
        proc = launch("python", BASE + ["train.seed=7", f"checkpoint.resume={step4}"], tmp_path / "seed")
    check_case("resume: train.seed changed", proc, t.seconds, 2, "train.seed=7 but the checkpoint was trained with 1234")
    with Timer() as t:
        proc = launch("python", BASE + ["model.rope_theta=500000", f"checkpoint.resume={step4}"], tmp_path / "rope")
    check_case("resume: model.rope_theta changed", proc, t.seconds, 2, "model.rope_theta=500000.0")


def test_disk_full_on_a_small_filesystem_keeps_earlier_checkpoints(tmp_path):
    """The run directory on a 4 MiB tmpfs: the third checkpoint (about 1.4 MiB each) no longer fits."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root): no small filesystem to fill")
    try:
        run = small / "run"
        with Timer() as t:
            proc = launch("python", BASE + ["checkpoint.every=2", "train.max_steps=12"], run)
        check_case("disk full: run directory on a 4 MiB filesystem", proc, t.seconds, 4, "No space left on device")
        kept = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
        assert kept and not list((run / "checkpoints").glob(".tmp-*")), kept  # nothing half-written left
        from trainer.checkpoint import manager as ckpt

        for name in kept:  # every checkpoint left is complete and intact
            path = str(run / "checkpoints" / name)
            ckpt.verify_files(path, ckpt.read_meta(path), checksums=True)
        _strict_json_lines(run / "metrics.jsonl")
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)
