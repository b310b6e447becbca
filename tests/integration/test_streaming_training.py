"""data.streaming=true end to end (real processes): a folder of JSONL shards read as training goes gives the
one-process curve on two DDP ranks and under ZeRO-2 (fp32), crosses an epoch boundary with a new shard order,
and a run resumed from a checkpoint at another world size continues at the exact token."""
from __future__ import annotations

import json

import pytest

from tests.integration.conftest import FP32_TOL, SMALL, curve_errors, launch, metrics, ok

WORDS = "the quick brown fox jumps over a lazy dog while rivers run to the sea and birds sing".split()
RUN = [o for o in SMALL if not o.startswith("data.")] + [
    "data=text", "data.streaming=true", "data.seq_len=32", "data.val_fraction=0.1", "train.max_steps=6",
    "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2", "eval.every=3",
    "eval.max_sequences=8", "export.hf_at_end=false", "checkpoint.every=3", "checkpoint.keep_last=0",
    "checkpoint.at_end=true"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Four JSONL shards holding about two global batches of training tokens: 6 steps are ~3 epochs."""
    root = tmp_path_factory.mktemp("stream-corpus")
    for f in range(4):
        lines = [json.dumps({"text": " ".join(WORDS[(f * 5 + i + j) % len(WORDS)] for j in range(4 + (i + f) % 7))})
                 for i in range(5)]
        (root / f"shard{f}.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stream-single")
    proc = launch("python", RUN + [f"data.path={corpus}", "strategy=single"], run_dir)
    ok(proc)
    assert "streaming data.path=" in proc.stdout + proc.stderr
    return run_dir


def _loader(run_dir, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step}" / "meta.json").read_text())["loader"]


def test_the_stream_crosses_epochs_and_its_position_is_in_each_checkpoint(single):
    first, last = _loader(single, 3), _loader(single, 6)
    assert first["consumed_batches"] == 3 and last["consumed_batches"] == 6
    assert last["stream"]["epoch"] > first["stream"]["epoch"] >= 1, (first, last)
    assert [r["step"] for r in metrics(single)] == list(range(1, 7))


@pytest.mark.parametrize("launcher,strategy", [("torchrun", "ddp"), ("torchrun", "zero2")])
def test_two_ranks_train_the_one_process_curve_from_a_stream(corpus, single, tmp_path, launcher, strategy):
    ok(launch(launcher, RUN + [f"data.path={corpus}", f"strategy={strategy}"], tmp_path, nproc=2))
    loss_err, norm_err = curve_errors(metrics(tmp_path), metrics(single), same_steps=True)
    print(f"data.streaming {strategy} ws2 vs one process: loss {loss_err:.2e}, grad norm {norm_err:.2e}")
    assert loss_err < FP32_TOL and norm_err < FP32_TOL
    assert _loader(tmp_path, 6) == _loader(single, 6)  # the same stream position on any world size


def test_a_run_resumed_at_another_world_size_continues_at_the_exact_token(corpus, single, tmp_path):
    proc = launch("torchrun", RUN + [f"data.path={corpus}", "strategy=ddp",
                                     f"checkpoint.resume={single / 'checkpoints' / 'step_3'}"], tmp_path, nproc=2)
    ok(proc)
    resumed = metrics(tmp_path)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    loss_err, norm_err = curve_errors(resumed, metrics(single))
    print(f"data.streaming resumed ws1 -> ws2: loss {loss_err:.2e}, grad norm {norm_err:.2e}")
    assert loss_err < FP32_TOL and norm_err < FP32_TOL
    assert _loader(tmp_path, 6) == _loader(single, 6)
