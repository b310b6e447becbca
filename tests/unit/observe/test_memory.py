"""The memory report (logging.memory_report, trainer/observe/memory.py + trainer/observe/model_states.py) on the in-process
strategies (single, ddp and fsdp at one rank): exact byte counts through public APIs, the first-step probes and
memory.json, nothing of it when the key is off; and MFU in metrics.jsonl with logging.peak_tflops."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import compose_config
from trainer.observe.model_states import StateBytes, state_bytes

SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.intermediate_size=128", "data.embedded_documents=400", "data.seq_len=32", "logging.progress=false",
         "logging.tensorboard=false", "train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=1",
         "eval.every=0", "eval.at_end=false", "export.hf_at_end=false", "checkpoint.at_end=false",
         "checkpoint.resume=none", "precision=fp32"]


@pytest.fixture
def build_run(tmp_path, monkeypatch):
    """build_run(strategy) -> a built Run (closed at teardown). ddp gets a one-rank gloo group on a free port; the
    environment it sets is restored afterwards."""
    from trainer.run import build as B
    from trainer.parallel.dims import free_port

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(key, value)
    runs = []

    def make(strategy: str, extra=(), name=None):
        cfg = compose_config(SMALL + [f"strategy={strategy}", *extra])
        run = B.build(B.prepare(cfg, str(tmp_path / (name or strategy))))
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

    before = state_bytes(run.strategy)
    assert before["params"] == param_bytes
    assert before["grads"] == before["optimizer"] == before["master_params"] == before["gathered"] == 0

    _one_step_keeping_grads(run)
    m = state_bytes(run.strategy)
    assert m["params"] == param_bytes
    assert m["grads"] == param_bytes  # ddp: gradients are views into its buckets, each counted by its own bytes
    step_scalars = sum(st["step"].numel() * st["step"].element_size() for st in run.strategy.optimizer.state.values())
    assert step_scalars == 4 * len(params)  # one fp32 `step` per parameter tensor
    assert m["optimizer"] == 2 * param_bytes + step_scalars  # exp_avg + exp_avg_sq + the step scalars
    assert m["master_params"] == m["gathered"] == 0

    run.strategy.optimizer.zero_grad(set_to_none=True)
    assert state_bytes(run.strategy)["grads"] == 0


def test_memory_report_and_mfu_of_a_run(build_run):
    """logging.memory_report=true: memory.json after the first step, with the figures of each probe point;
    logging.peak_tflops=x: metrics.jsonl carries mfu = sequence tokens/s x FLOPs per token / (x 1e12 x world).
    The default run (memory_report=false, no peak on the CPU) writes neither and arms no hook."""
    from trainer.run.loop import fit
    from trainer.observe.metrics import flops_per_token

    peak = 0.5
    run = build_run("single", ["logging.memory_report=true", f"logging.peak_tflops={peak}", "train.max_steps=2",
                                "train.log_every=1"])
    param_bytes = sum(p.numel() * 4 for p in run.strategy.unwrapped().parameters())
    fit(run)
    data = json.loads((Path(run.run_dir) / "memory.json").read_text())
    assert data["world_size"] == 1 and data["strategy"] == "single" and data["num_params"] * 4 == param_bytes
    assert data["step"] == 1  # the first step
    (rank,) = data["ranks"]
    assert rank["errors"] == [] and rank["built_params"] == param_bytes  # built whole, in fp32
    in_step, after = rank["points"]["optimizer_step"], rank["points"]["after_step"]
    assert in_step["grads"] == param_bytes  # measured inside the step: gradients are live
    assert after["grads"] == 0  # zero_grad(set_to_none=True) freed them
    assert rank["grads"] == param_bytes and rank["params"] == param_bytes  # the peaks over the points
    assert rank["peak_point"]["grads"] == "optimizer_step"
    n_tensors = len(list(run.strategy.model.parameters()))
    assert rank["optimizer"] == after["optimizer"] == 2 * param_bytes + 4 * n_tensors  # moments + step scalars
    assert rank["model_states"] == rank["params"] + rank["grads"] + rank["optimizer"] + rank["master_params"]

    info, cfg = run.model_info, run.cfg
    flops = flops_per_token(run.num_params - info.vocab_size * info.hidden_size, info.num_layers, info.hidden_size,
                            cfg.data.seq_len)
    records = [json.loads(line) for line in (Path(run.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["seq_tokens_per_s"] > 0
        assert r["mfu"] == pytest.approx(r["seq_tokens_per_s"] * flops / (peak * 1e12 * 1), rel=1e-9)

    default = build_run("single", name="default")
    assert not default.cfg.logging.memory_report and default.built_param_bytes == 0
    fit(default)
    assert not (Path(default.run_dir) / "memory.json").exists()
    assert "mfu" not in json.loads((Path(default.run_dir) / "metrics.jsonl").read_text().splitlines()[0])


def test_each_tensor_counts_once_by_its_own_bytes():
    flat = torch.zeros(100)
    bucket = torch.empty(1000, dtype=torch.bfloat16)
    count = StateBytes()
    count.add("params", flat[:50])
    count.add("params", flat[50:])
    count.add("params", flat[50:])  # the same view again: not again
    count.add("grads", bucket[:300])  # a gradient in a bucket: its own bytes, not the bucket's
    count.add("grads", None)
    count.add("optimizer", torch.empty(0))  # empty: nothing
    assert count.bytes == {"params": 400, "master_params": 0, "optimizer": 0, "grads": 600, "gathered": 0}


def test_fsdp_counts_local_shards_and_gathered_parameters(build_run):
    """FSDP2 at one rank (a shard group of 1): DTensor parameters, gradients and AdamW state are counted by their
    local tensors; the all-gathered bf16 parameters FSDP registers on a module between its all-gather and its
    reshard are `gathered` (the root, never resharded after forward, and one block at a time); no master copy."""
    from trainer.run.loop import fit

    run = build_run("fsdp", ["precision=bf16", "logging.memory_report=true"])
    params = list(run.strategy.unwrapped().parameters())
    assert all(type(p).__name__ == "DTensor" for p in params)
    psi = sum(p.numel() for p in params)
    before = state_bytes(run.strategy)
    assert before["params"] == 4 * psi  # fp32 shards (the whole model at one rank)
    assert before["grads"] == before["optimizer"] == before["master_params"] == before["gathered"] == 0
    assert run.built_param_bytes == 0  # built on the meta device

    fit(run)
    data = json.loads((Path(run.run_dir) / "memory.json").read_text())
    (rank,) = data["ranks"]
    units = data["fsdp"]["unit_params"]
    assert data["fsdp"]["shard_size"] == 1 and sum(units) == psi == data["num_params"]
    assert set(rank["points"]) == {"forward", "backward", "optimizer_step", "after_step"}
    assert rank["errors"] == []
    assert rank["gathered"] == 2 * (units[0] + max(units[1:])) and rank["peak_point"]["gathered"] == "forward"
    assert rank["points"]["after_step"]["gathered"] == 0
    assert rank["params"] == 4 * psi and rank["master_params"] == 0
    assert rank["grads"] == 4 * psi and rank["peak_point"]["grads"] == "optimizer_step"  # fp32 gradient shards
    assert rank["optimizer"] == 8 * psi + 4 * len(params)
    assert rank["model_states"] == rank["params"] + rank["grads"] + rank["optimizer"] + rank["master_params"]


def test_activations_are_what_autograd_holds_at_once_without_parameters_or_their_casts():
    """Linear -> GELU -> Linear on 8 rows: autograd keeps the input (8 x 32 fp32), GELU's input and the second
    layer's input (8 x 64 each), never the weights (nor their transposes, nor autocast's bf16 copies). Two
    forwards before their backwards (a pipeline's micro-batches in flight) hold twice that; backward frees it."""
    from trainer.observe.memory import SavedActivations

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    rows = [torch.randn(8, 32) for _ in range(2)]
    one = 8 * 32 * 4 + 2 * 8 * 64 * 4
    probe = SavedActivations()
    try:
        model(rows[0]).sum().backward()
        assert (probe.peak, probe.current) == (one, 0)
        losses = [model(x).sum() for x in rows]
        assert probe.current == probe.peak == 2 * one
        for loss in losses:
            loss.backward()
        assert probe.current == 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(rows[0]).float().sum()
        held = probe.current  # bf16 casts of the input and activations, none of the weights
        loss.backward()
    finally:
        probe.close()
    assert held == one // 2, held  # the same three, in bf16
