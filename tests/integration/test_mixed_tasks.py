"""data.kind=mixture end to end: a text source and an SFT source mixed by weight. Per-task losses and tokens in
metrics.jsonl add up to the step's, per-task validation losses in eval.jsonl, the same numbers on 2 ranks of ZeRO-2
as on one process, and a resumed run continues exactly (real processes, gloo)."""
from __future__ import annotations

import shutil

import pytest

from tests.integration.conftest import SMALL, check_parity, launch, metrics, ok, read_jsonl, rel_err

STEPS = 4


def _overrides(source):
    sources = (f"data.sources=[{{name: plays, kind: text, path: {source.text}, weight: 1}}, "
               f"{{name: alpaca, kind: sft, path: {source.alpaca}, weight: 1}}]")
    return [o for o in SMALL if not o.startswith("data.")] + [
        "data=mixture", sources, "data.seq_len=128", f"train.max_steps={STEPS}", "train.log_every=1",
        "train.global_batch_size=8", "train.micro_batch_size=2", "eval.every=2", "eval.max_sequences=8",
        "export.hf_at_end=false", "checkpoint.every=2", "checkpoint.at_end=false"]


@pytest.fixture(scope="module")
def single(generated_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("mixture-single")
    ok(launch("python", _overrides(generated_data) + ["strategy=single"], run))
    return run


def test_per_task_losses_and_tokens_add_up_to_the_step(single):
    recs = metrics(single)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    before = 0
    for r in recs:
        tasks = r["tasks"]
        assert set(tasks) == {"plays", "alpaca"} and all(t["tokens"] > 0 for t in tasks.values())
        assert sum(t["tokens"] for t in tasks.values()) == r["tokens"] - before  # the step's target tokens
        mean = sum(t["loss"] * t["tokens"] for t in tasks.values()) / (r["tokens"] - before)
        assert rel_err(mean, r["loss"]) < 1e-6
        before = r["tokens"]
    evals = read_jsonl(single / "eval.jsonl")
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        assert set(e["val_loss_by_task"]) == {"plays", "alpaca"}
        assert min(e["val_loss_by_task"].values()) <= e["val_loss"] <= max(e["val_loss_by_task"].values())


# zero2: DeepSpeed's own forward/backward path; the single-process reference runs the torch-native one
@pytest.mark.parametrize("strategy", ["zero2"])
def test_mixed_batches_train_the_same_on_every_layout(generated_data, single, tmp_path, strategy):
    ok(launch("torchrun", _overrides(generated_data) + [f"strategy={strategy}"], tmp_path, nproc=2))
    got, ref = metrics(tmp_path), metrics(single)
    check_parity(f"mixture {strategy}", got, ref, steps=STEPS)
    for a, b in zip(got, ref):
        for name in ("plays", "alpaca"):
            assert a["tasks"][name]["tokens"] == b["tasks"][name]["tokens"]
            assert rel_err(a["tasks"][name]["loss"], b["tasks"][name]["loss"]) < 1e-6


def test_a_resumed_mixture_continues_exactly(generated_data, single, tmp_path):
    shutil.copytree(single / "checkpoints" / "step_2", tmp_path / "checkpoints" / "step_2")
    ok(launch("python", _overrides(generated_data) + ["strategy=single", "checkpoint.resume=auto"], tmp_path))
    ref = {r["step"]: r for r in metrics(single)}
    got = metrics(tmp_path)
    assert [r["step"] for r in got] == [3, 4]
    assert [(r["loss"], r["tasks"]) for r in got] == [(ref[r["step"]]["loss"], ref[r["step"]]["tasks"]) for r in got]
