"""trainer/memory.py on the in-process strategies (single, ddp and fsdp at one rank): exact byte counts from the
live tensors, storage dedup, and the first-step probes of the training loop (memory.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import compose_config
from trainer.memory import Tally, gather_memory, measure_model_states

SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.intermediate_size=128", "data.embedded_documents=400", "data.seq_len=32", "logging.progress=false",
         "logging.tensorboard=false", "train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=1",
         "eval.every=0", "eval.at_end=false", "export.hf_at_end=false", "checkpoint.at_end=false",
         "checkpoint.resume=none", "precision=fp32"]


@pytest.fixture
def build_run(tmp_path, monkeypatch):
    """build_run(strategy) -> a built Run (closed at teardown). ddp gets a one-rank gloo group on a free port; the
    environment it sets is restored afterwards."""
    from trainer import build as B
    from trainer.parallel import free_port

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(key, value)
    runs = []

    def make(strategy: str, extra=()):
        cfg = compose_config(SMALL + [f"strategy={strategy}", *extra])
        run = B.build(B.prepare(cfg, str(tmp_path / strategy)))
        runs.append(run)
        return run

    yield make
    for run in runs:
        B.close(run, graceful=False)


def _one_step_keeping_grads(run):
    """forward/backward and optimizer.step() of step 0, without zero_grad: gradients and AdamW state both live."""
    s, t = run.strategy, run.cfg.train
    batch = run.sampler.global_batch(0)
    positions = run.sampler.micro_batches(0, s.dp_rank, s.dp_size, t.micro_batch_size)
    s.forward_backward([run.data.train.get(pos) for pos in positions], run.data.train.count_targets(batch))
    s.optimizer.step()


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_counts_are_exact_for_plain_strategies(build_run, strategy):
    run = build_run(strategy)
    params = list(run.strategy.unwrapped().parameters())
    param_bytes = sum(p.numel() * 4 for p in params)

    before = measure_model_states(run.strategy)
    assert before["params"] == param_bytes
    assert before["grads"] == before["optimizer"] == before["master_params"] == 0

    _one_step_keeping_grads(run)
    m = measure_model_states(run.strategy)
    assert m["params"] == param_bytes
    assert m["grads"] == param_bytes  # ddp: gradients are views into its buckets, which hold exactly them
    step_scalars = sum(st["step"].untyped_storage().nbytes() for st in run.strategy.optimizer.state.values())
    assert step_scalars == 4 * len(params)  # one fp32 `step` per parameter tensor
    assert m["optimizer"] == 2 * param_bytes + step_scalars  # exp_avg + exp_avg_sq + the step scalars
    assert m["master_params"] == m["buffers"] == m["other"] == 0
    assert m["total"] == m["params"] + m["grads"] + m["optimizer"]
    assert gather_memory(run.strategy, m) == [m]  # one rank (ddp: a one-rank group)

    run.strategy.optimizer.zero_grad(set_to_none=True)
    assert measure_model_states(run.strategy)["grads"] == 0


def test_the_loop_writes_memory_json_after_the_first_step(build_run):
    from trainer.loop import fit

    run = build_run("single")
    param_bytes = sum(p.numel() * 4 for p in run.strategy.unwrapped().parameters())
    fit(run)
    data = json.loads((Path(run.run_dir) / "memory.json").read_text())
    assert data["world_size"] == 1 and data["strategy"] == "single" and data["num_params"] * 4 == param_bytes
    (rank,) = data["ranks"]
    in_step, after = rank["points"]["optimizer_step"], rank["points"]["after_step"]
    assert in_step["grads"] == param_bytes  # measured inside the step: gradients are live
    assert after["grads"] == 0  # zero_grad(set_to_none=True) freed them
    assert rank["grads"] == param_bytes and rank["params"] == param_bytes  # the peaks over the points
    assert rank["optimizer"] == after["optimizer"] > 2 * param_bytes
    assert rank["model_states"] == rank["params"] + rank["grads"] + rank["optimizer"] + rank["master_params"]


def test_each_storage_counts_once_and_bucket_views_count_as_gradients():
    flat = torch.zeros(100)
    bucket = torch.empty(1000, dtype=torch.bfloat16)
    tally = Tally()
    tally.add("params", flat[:50], "a")
    tally.add("params", flat[50:], "a")  # the same storage: not again
    tally.add("grads", flat, "b")  # already counted as params: not again
    tally.share(bucket, "bucket")
    tally.add("grads", bucket[:300], "g")
    tally.add("grads", bucket[200:400], "g")  # overlapping views: 400 elements in all
    tally.add("other", bucket, "walk")  # found again by a walk: still the bucket
    out = tally.result()
    assert out["params"] == 400 and out["grads"] == 400 * 2 and out["buffers"] == 600 * 2
    assert out["total"] == 400 + 2000
    assert out["detail"]["grads"] == {"bucket (gradient views)": 800}


def test_fsdp_counts_local_shards_and_gathered_parameters(build_run):
    """FSDP2 at one rank (a shard group of 1): DTensor parameters, gradients and AdamW state are counted by their
    local tensors, each storage once; nothing is gathered outside forward/backward; no master copy."""
    run = build_run("fsdp", ["precision=bf16"])
    params = list(run.strategy.unwrapped().parameters())
    assert all(type(p).__name__ == "DTensor" for p in params)
    psi = sum(p.numel() for p in params)
    before = measure_model_states(run.strategy)
    assert before["params"] == 4 * psi  # fp32 shards (the whole model at one rank)
    assert before["grads"] == before["optimizer"] == before["master_params"] == before["gathered"] == 0

    _one_step_keeping_grads(run)
    m = measure_model_states(run.strategy)
    step_scalars = 4 * len(params)
    assert m["params"] == 4 * psi and m["grads"] == 4 * psi  # fp32 gradient shards (fp32 reduce)
    assert m["optimizer"] == 8 * psi + step_scalars
    assert m["master_params"] == m["gathered"] == m["other"] == 0  # resharded after backward
    assert set(m["detail"]["grads"]) == {"sharded gradients (DTensor local shards)"}


def test_the_loop_probes_fsdp_forward_and_backward(build_run):
    from trainer.loop import fit

    run = build_run("fsdp", ["precision=bf16"])
    fit(run)
    data = json.loads((Path(run.run_dir) / "memory.json").read_text())
    (rank,) = data["ranks"]
    psi, units = data["num_params"], data["fsdp"]["unit_params"]
    assert data["fsdp"]["shard_size"] == 1 and sum(units) == psi
    assert set(rank["points"]) == {"forward", "backward", "optimizer_step", "after_step"}
    assert rank["errors"] == [] and rank["built_params"] == 0
    # bf16 compute copies: the root (never resharded after forward) and one block at a time.
    assert rank["gathered"] == 2 * (units[0] + max(units[1:])) and rank["peak_point"]["gathered"] == "forward"
    assert rank["points"]["after_step"]["gathered"] == 0
    assert rank["grads"] == 4 * psi and rank["peak_point"]["grads"] == "optimizer_step"
    assert rank["model_states"] == rank["params"] + rank["grads"] + rank["optimizer"] + rank["master_params"]
