"""Bad input: one clear message, a non-zero exit, no traceback, no hang (also with several ranks)."""
from __future__ import annotations

import pytest

from tests.integration.conftest import SMALL, launch

QUICK = SMALL + ["train.max_steps=2", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false"]


def _files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nofield.jsonl").write_text('{"body": "a"}\n{"body": "b"}\n')
    (tmp_path / "broken.jsonl").write_text('{"text": "a"\n')
    (tmp_path / "bad.parquet").write_text("not a parquet file")
    (tmp_path / "sft_noanswer.jsonl").write_text('{"instruction": "hi", "output": ""}\n')
    return tmp_path


CASES = [
    # (name, overrides, launcher, nproc, expected text in the message)
    ("unknown-key", ["train.bogus=1"], "python", 1, "bogus"),
    ("missing-model-folder", ["model=hf", "model.name_or_path={tmp}/no-such-model"], "torchrun-quiet", 2,
     "no such folder"),
    ("empty-data-file", ["data=text", "data.path={tmp}/empty.txt"], "torchrun-quiet", 2, "is empty"),
    ("missing-data-file", ["data=text", "data.path={tmp}/nothing.txt"], "python", 1, "no such file"),
    ("unreadable-jsonl", ["data=text", "data.path={tmp}/broken.jsonl"], "python", 1, "cannot read"),
    ("unreadable-parquet", ["data=text", "data.path={tmp}/bad.parquet"], "python", 1, "cannot read"),
    ("jsonl-without-field", ["data=text", "data.path={tmp}/nofield.jsonl"], "python", 1,
     "no 'text' field"),
    ("sft-without-answer", ["data=sft", "data.path={tmp}/sft_noanswer.jsonl"], "python", 1,
     "non-empty 'output'"),
    ("seq-len-over-max", ["data.seq_len=4096", "model.max_position_embeddings=512"], "python", 1,
     "data.seq_len=4096 exceeds model.max_position_embeddings=512"),
    ("single-on-two-ranks", ["strategy=single"], "torchrun-quiet", 2, "strategy=single runs one process"),
    ("degree-not-used", ["strategy=ddp", "strategy.tp=2"], "torchrun-quiet", 2, "does not use strategy.tp"),
    ("batch-not-divisible", ["train.global_batch_size=6", "train.micro_batch_size=2"], "torchrun-quiet", 2,
     "train.global_batch_size=6 must be divisible"),
]


@pytest.mark.parametrize("name,overrides,launcher,nproc,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_with_one_clear_message(tmp_path, name, overrides, launcher, nproc, expected):
    files = _files(tmp_path)
    args = QUICK + [o.format(tmp=files) for o in overrides]
    if launcher == "python" and not any(o.startswith("strategy=") for o in overrides):
        args.append("strategy=single")
    proc = launch(launcher, args, tmp_path / "run", nproc=nproc, timeout=120)  # a hang fails by timeout
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert expected in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    if nproc > 1:
        # Rank 0 prints the message; the same config problem is not repeated by every rank.
        assert out.count(expected) == 1 or "[rank 1]" in out, out[-3000:]


def test_all_config_problems_reported_together(tmp_path):
    proc = launch("python", QUICK + ["strategy=single", "train.global_batch_size=10", "train.micro_batch_size=4",
                                     "optim.name=adam", "data.seq_len=4096", "scheduler.name=step"],
                  tmp_path / "run", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2
    for key in ("train.global_batch_size=10", "optim.name='adam'", "data.seq_len=4096", "scheduler.name='step'"):
        assert key in out, out
    assert "4 configuration problem(s)" in out


def test_fsdp_config_problems_through_torchrun(tmp_path):
    """strategy=hsdp with shard groups of 3 on 2 ranks, plus a DeepSpeed offload key: exit 2 before any
    process group starts, both problems in one message printed once (rank 0), no traceback, no hang."""
    proc = launch("torchrun-quiet", QUICK + ["strategy=hsdp", "strategy.dp_shard=3", "strategy.offload_optimizer=cpu"],
                  tmp_path / "run", nproc=2, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert out.count("2 configuration problem(s)") == 1, out[-3000:]
    assert out.count("world size 2 is not divisible") == 1 and "strategy.dp_shard=3" in out, out[-3000:]
    assert out.count("strategy.offload_optimizer=cpu is a DeepSpeed option") == 1, out[-3000:]
    assert "set strategy.cpu_offload=true and strategy.offload_optimizer=none" in out, out[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
