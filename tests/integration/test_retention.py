"""checkpoint.keep_last with real processes (only the newest N complete checkpoints remain; pinned ones and the
newest are kept; an unfinished save is removed by the next one), and the resume refusals that no other test
covers with a real launch: other data, and a checkpoint in another strategy's format. (Another model, train.seed,
optim.name, train.global_batch_size and a Hugging Face config entry are refused in test_checkpoint.py and
test_integrity.py.) Each refusal: exit 2, one message naming what differs, no traceback."""
from __future__ import annotations

import json

import pytest

from tests.integration.catalogue import Timer, check_case
from tests.integration.conftest import SMALL, launch, metrics, ok

BASE = SMALL + ["strategy=single", "data.embedded_documents=60", "train.global_batch_size=8",
                "train.micro_batch_size=4", "train.log_every=1", "eval.every=0", "eval.at_end=false",
                "export.hf_at_end=false", "checkpoint.every=2"]


def _steps(run_dir) -> list:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def rotated(tmp_path_factory):
    """8 steps, a checkpoint every 2, keep_last=2."""
    run_dir = tmp_path_factory.mktemp("keep-last")
    ok(launch("python", BASE + ["train.max_steps=8", "checkpoint.keep_last=2"], run_dir))
    return run_dir


def test_keep_last_keeps_the_newest_complete_checkpoints(rotated):
    assert _steps(rotated) == [6, 8]
    for step in (6, 8):
        assert (rotated / "checkpoints" / f"step_{step}" / "COMPLETE.json").is_file()
    assert (rotated / "checkpoints" / "latest").read_text().strip() == "step_8"


def test_keep_last_spares_pinned_checkpoints_and_removes_unfinished_saves(rotated, tmp_path):
    """step_6 pinned (KEEP.json, as the divergence guard writes it) and a leftover unfinished save: resuming to
    step 14 with keep_last=2 leaves the pinned one and the newest two; the unfinished folder is gone."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(rotated, run)
    (run / "checkpoints" / "step_6" / "KEEP.json").write_text(json.dumps({"reason": "test", "time": 0}))
    (run / "checkpoints" / ".tmp-step_9").mkdir()
    (run / "checkpoints" / ".tmp-step_9" / "half.bin").write_bytes(b"\0" * 64)
    proc = launch("python", BASE + ["train.max_steps=14", "checkpoint.keep_last=2", "checkpoint.resume=auto"], run)
    ok(proc)
    assert "resumed from" in proc.stdout + proc.stderr
    assert [r["step"] for r in metrics(run)][-6:] == [9, 10, 11, 12, 13, 14]
    assert _steps(run) == [6, 12, 14], _steps(run)
    assert (run / "checkpoints" / "step_6" / "KEEP.json").is_file()
    assert not (run / "checkpoints" / ".tmp-step_9").exists()


def test_resume_with_other_data_is_refused(rotated, tmp_path):
    step = rotated / "checkpoints" / "step_8"
    with Timer() as t:
        proc = launch("python", BASE + ["train.max_steps=10", "data.embedded_documents=80", f"checkpoint.resume={step}"],
                      tmp_path / "docs")
    check_case("resume: other documents", proc, t.seconds, 2, "the data differs from the checkpoint's")
    assert not (tmp_path / "docs" / "metrics.jsonl").exists()  # refused before any step


def test_resume_of_a_dcp_checkpoint_under_zero_is_refused(rotated, tmp_path):
    """strategy=single saves DCP; ZeRO reads DeepSpeed's own format: refused, naming both and the way out."""
    with Timer() as t:
        proc = launch("python", BASE + ["strategy=zero2", "train.max_steps=10",
                                        f"checkpoint.resume={rotated / 'checkpoints' / 'step_8'}"], tmp_path / "z")
    check_case("resume: DCP checkpoint under strategy=zero2", proc, t.seconds, 2,
               "the checkpoint is in dcp format (saved by strategy=single) and strategy=zero2 reads")
    assert "python -m trainer.export" in proc.stdout + proc.stderr
