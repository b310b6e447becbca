"""Measured per-rank model-state memory under FSDP2 (torchrun, CPU/gloo): `strategy=fsdp` at world size 2 in bf16
and `strategy=hsdp` 2 x 2 at world size 4 in fp32 with `reshard_after_forward=false`, one step each. Every rank
holds 1/N_shard of the fp32 parameters (4Ψ/N), of the fp32 gradients (4Ψ/N; fp32 reduce) and of AdamW's moments
(8Ψ/N), no separate master copy, and all-gathers the parameters (bf16 / fp32) only while computing. Measured with
logging.memory_report=true through public APIs: the optimizer's DTensor shards and the parameters FSDP registers on
its modules while they are all-gathered."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.conftest import SMALL, launch, ok, rel_err

ONE_STEP = SMALL + ["train.max_steps=1", "train.micro_batch_size=1", "eval.every=0", "eval.at_end=false",
                    "export.hf_at_end=false", "checkpoint.at_end=false", "logging.tensorboard=false",
                    "logging.memory_report=true"]
RUNS = {
    # name: (processes, overrides, shard group size)
    "fsdp": (2, ["strategy=fsdp", "precision=bf16", "train.global_batch_size=4"], 2),  # 2 micro-batches per rank
    "hsdp": (4, ["strategy=hsdp", "strategy.dp_replicate=2", "strategy.dp_shard=2", "precision=fp32",
                 "strategy.reshard_after_forward=false", "train.global_batch_size=4"], 2),
}
TOL = 0.10  # FSDP pads dim 0 to a multiple of the shard size; AdamW adds a 4-byte `step` per tensor


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    """name -> memory.json of that run. The runs start together (they are mostly start-up time)."""
    root = tmp_path_factory.mktemp("memory_fsdp")

    def run(name):
        nproc, extra, _ = RUNS[name]
        ok(launch("torchrun", ONE_STEP + extra, root / name, nproc=nproc, timeout=240))
        return json.loads((root / name / "memory.json").read_text())

    with ThreadPoolExecutor(len(RUNS)) as pool:
        return dict(zip(RUNS, pool.map(run, RUNS)))


def _after(data, key):
    return [r["points"]["after_step"][key] for r in data["ranks"]]


@pytest.mark.parametrize("name", RUNS)
def test_every_rank_reports(memory, name):
    data, (nproc, _, shard) = memory[name], RUNS[name]
    assert data["world_size"] == nproc and data["dp_size"] == nproc and data["strategy"] == name
    assert data["fsdp"]["shard_size"] == shard
    assert sum(data["fsdp"]["unit_params"]) == data["num_params"]  # the root and every block, each once
    assert [r["rank"] for r in data["ranks"]] == list(range(nproc))
    for r in data["ranks"]:
        assert r["errors"] == []
        assert set(r["points"]) == {"forward", "backward", "optimizer_step", "after_step"}
        assert r["model_states"] == r["params"] + r["grads"] + r["optimizer"] + r["master_params"]
        assert r["built_params"] == 0  # built on the meta device: no rank ever held the whole model


@pytest.mark.parametrize("name", RUNS)
def test_model_states_are_sharded(memory, name):
    """fp32 shards of parameters, gradients and AdamW state: 4Ψ/N + 4Ψ/N + 8Ψ/N per rank, no master copy."""
    data, (_, _, n) = memory[name], RUNS[name]
    psi = data["num_params"]
    for got in _after(data, "params"):
        assert rel_err(got, 4 * psi / n) < TOL, (got, psi)
    for got in _after(data, "optimizer"):
        assert rel_err(got, 8 * psi / n) < TOL, (got, psi)
    for r in data["ranks"]:
        assert r["master_params"] == 0  # the fp32 shards are the parameters (bf16: FSDP casts what it gathers)
        assert rel_err(r["points"]["optimizer_step"]["grads"], 4 * psi / n) < TOL  # fp32 reduce-scatter output
        assert r["peak_point"]["grads"] == "optimizer_step"
        assert r["points"]["after_step"]["grads"] == 0  # zero_grad(set_to_none=True)
        assert rel_err(r["model_states"], 16 * psi / n) < TOL, (r["model_states"], psi)


def test_gathered_parameters_follow_reshard_after_forward(memory):
    """Gathered parameters exist only in forward/backward. reshard_after_forward=true (fsdp): the root (it never
    reshards after forward) plus one block at a time, in bf16; false (hsdp): every block stays gathered until
    its backward, so after forward the whole model is there, in fp32."""
    fsdp, hsdp = memory["fsdp"], memory["hsdp"]
    units = fsdp["fsdp"]["unit_params"]  # the root first, then the blocks
    one_block = 2 * (units[0] + max(units[1:]))
    for r in fsdp["ranks"]:
        assert r["gathered"] == one_block, (r["gathered"], units)
        assert r["gathered"] < 0.9 * 2 * fsdp["num_params"]
        assert r["points"]["after_step"]["gathered"] == 0
    for r in hsdp["ranks"]:
        assert r["gathered"] == 4 * hsdp["num_params"], (r["gathered"], hsdp["num_params"])
        assert r["points"]["after_step"]["gathered"] == 0


def test_hsdp_replicas_hold_the_same(memory):
    ranks = memory["hsdp"]["ranks"]
    for key in ("params", "grads", "optimizer"):
        assert len({r[key] for r in ranks}) == 1, (key, [r[key] for r in ranks])
