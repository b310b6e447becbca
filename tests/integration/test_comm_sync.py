"""Communication cost: comm_bytes in metrics.jsonl (logging.comm_bytes=true; off by default) against formulas,
DDP's compression hooks (bf16, PowerSGD) and less frequent synchronisation (local SGD, DiLoCo, overlapped), each
resumed exactly from a checkpoint taken in the middle of a round. Real processes with gloo, 2 ranks."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.integration.conftest import FP32_TOL, REPO, SMALL, launch, metrics, ok, rel_err

# 8 steps of SGD (its update is linear in the gradient: local SGD with sync.every=1 is then DDP), accumulation 2.
BASE = SMALL + ["strategy=ddp", "optim=sgd", "optim.lr=0.05", "train.grad_clip=0", "train.max_steps=8",
                "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2", "eval.every=0",
                "eval.at_end=false", "export.hf_at_end=false", "checkpoint.keep_last=0", "logging.comm_bytes=true"]
# mode -> (overrides, checkpoint step to resume from: inside a round, with state in flight)
MODES = {
    "ddp": ([], None),
    "bf16": (["strategy.comm_hook=bf16"], 3),
    # small buckets asked for: on gloo Tessera keeps PowerSGD to one bucket (its collectives' order), which DDP
    # still lays out anew after a restart; PowerSGD's state must follow the parameters
    "powersgd": (["strategy.comm_hook=powersgd", "strategy.powersgd_rank=2", "strategy.powersgd_warmup_steps=3",
                  "strategy.bucket_cap_mb=0.1"], 5),
    "local_sgd_h1": (["sync=local_sgd", "sync.every=1"], None),
    "local_sgd_h4": (["sync=local_sgd", "sync.every=4"], 6),
    "diloco_h4": (["sync=diloco", "sync.every=4", "optim=adamw", "optim.lr=0.003"], 6),
    "diloco_h2_overlap": (["sync=diloco", "sync.every=2", "sync.overlap=true"], 5),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """mode -> run dir of 8 uninterrupted steps (checkpoints every few steps where the mode resumes)."""
    out = {}
    for mode, (extra, every) in MODES.items():
        run_dir = tmp_path_factory.mktemp(mode)
        ckpt = [f"checkpoint.every={every}"] if every else ["checkpoint.at_end=false"]
        ok(launch("torchrun", BASE + extra + ckpt, run_dir, nproc=2))
        out[mode] = run_dir
    return out


@pytest.fixture(scope="module")
def shapes(runs):
    """name -> shape of the model's trained parameters (tied ones once), from the saved config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = runs["bf16"] / "checkpoints" / "step_3" / "hf_config"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_ddp_moves_the_gradient_once_per_step_and_bf16_half_of_it(runs, shapes):
    grad_bytes = 4 * sum(_numel(s) for s in shapes.values())
    ddp, bf16 = metrics(runs["ddp"]), metrics(runs["bf16"])
    assert [r["comm_bytes"] for r in ddp] == [grad_bytes] * 8  # accumulation 2, one reduction
    assert [r["comm_bytes"] for r in bf16] == [grad_bytes // 2] * 8
    # bf16 compression of the reduction: close to the fp32 curve, not identical
    errors = [rel_err(b["loss"], d["loss"]) for b, d in zip(bf16, ddp)]
    print(f"bf16 hook vs fp32: max relative loss error {max(errors):.2e}")
    assert max(errors) < 2e-3 and max(errors) > 0


# Runs trainer/main.py unchanged; at exit each rank writes what its collective functions were.
_PROBE = """
import atexit, json, os, runpy, sys

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d

original = dist.all_reduce


def report():
    wrapped = sorted(f"{mod.__name__}.{name}" for mod in (dist, distributed_c10d, funcol) for name in dir(mod)
                     if hasattr(getattr(mod, name), "tessera_counted"))
    path = os.path.join(os.environ["PROBE_OUT"], f"rank{os.environ.get('RANK', '0')}.json")
    with open(path, "w") as fh:
        json.dump({"original_all_reduce": dist.all_reduce is original, "wrapped": wrapped}, fh)


atexit.register(report)
sys.argv = [MAIN, *sys.argv[1:]]
runpy.run_path(MAIN, run_name="__main__")
"""


def _probed_launch(overrides, run_dir, nproc: int) -> list:
    """Each rank's {"original_all_reduce", "wrapped"} at the end of a run of trainer/main.py."""
    import json

    from trainer.launch.choose import MAIN, launcher_command, run_process_group

    script = run_dir / "probe_main.py"
    script.write_text(f"MAIN = {MAIN!r}\n" + _PROBE)
    out = run_dir / "probe"
    out.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PROBE_OUT=str(out),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = launcher_command("torchrun", nproc, script=str(script)) + list(overrides) + [f"hydra.run.dir={run_dir}"]
    ok(run_process_group(cmd, env=env, timeout=300))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_comm_bytes_off_by_default_replaces_nothing_and_trains_the_same(runs, tmp_path):
    """Without logging.comm_bytes no collective function is wrapped, metrics.jsonl has no comm_bytes, and the
    run's losses and gradient norms are those of the same run with comm_bytes on (runs["ddp"])."""
    base = [o for o in BASE if o != "logging.comm_bytes=true"] + ["checkpoint.at_end=false"]
    assert base != BASE
    probes = _probed_launch(base, tmp_path, nproc=2)
    assert probes == [{"original_all_reduce": True, "wrapped": []}] * 2
    off, on = metrics(tmp_path), metrics(runs["ddp"])
    assert not any(k.startswith("comm_bytes") for r in off for k in r)
    assert all("comm_bytes" in r and "comm_bytes_by_kind" in r for r in on)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in off] == [(r["step"], r["loss"], r["grad_norm"]) for r in on]


def test_comm_bytes_on_wraps_the_collectives(tmp_path):
    probes = _probed_launch(BASE + ["checkpoint.at_end=false", "train.max_steps=1"], tmp_path, nproc=2)
    for probe in probes:
        assert not probe["original_all_reduce"]
        assert {"torch.distributed.all_reduce", "torch.distributed.distributed_c10d.all_reduce",
                "torch.distributed.all_gather_into_tensor"} <= set(probe["wrapped"]), probe
    assert metrics(tmp_path)[0]["comm_bytes"] > 0


def test_powersgd_sends_rank_r_factors_after_warmup(runs, shapes):
    r = 2
    expected = 0
    for shape in shapes.values():
        rows, cols = shape[0], _numel(shape) // shape[0]
        rank = min(rows, cols, r)
        compress = len(shape) > 1 and (rows + cols) * rank * 2 < rows * cols
        expected += 4 * ((rows + cols) * rank if compress else rows * cols)
    full = 4 * sum(_numel(s) for s in shapes.values())
    got = [rec["comm_bytes"] for rec in metrics(runs["powersgd"])]
    print(f"PowerSGD rank {r}: {expected} bytes per step against {full} uncompressed ({full / expected:.1f}x)")
    assert got == [full] * 3 + [expected] * 5


def test_local_sgd_every_step_is_ddp(runs, shapes):
    ddp, local = metrics(runs["ddp"]), metrics(runs["local_sgd_h1"])
    loss_err = max(rel_err(a["loss"], b["loss"]) for a, b in zip(local, ddp))
    print(f"local SGD, sync.every=1, vs DDP (SGD): max relative loss error {loss_err:.2e}")
    assert loss_err < FP32_TOL
    assert [r["comm_bytes"] for r in local] == [4 * sum(_numel(s) for s in shapes.values())] * 8


@pytest.mark.parametrize("mode,every", [("local_sgd_h4", 4), ("diloco_h4", 4), ("diloco_h2_overlap", 2)])
def test_periodic_sync_moves_the_weights_every_h_steps(runs, shapes, mode, every):
    weight_bytes = 4 * sum(_numel(s) for s in shapes.values())
    got = [r["comm_bytes"] for r in metrics(runs[mode])]
    assert got == [weight_bytes if step % every == 0 else 0 for step in range(1, 9)]
    assert metrics(runs[mode])[-1]["loss"] < metrics(runs[mode])[0]["loss"] - 0.3  # it trains


@pytest.mark.parametrize("mode", [m for m, (_, every) in MODES.items() if every])
def test_resume_is_exact(runs, tmp_path, mode):
    extra, every = MODES[mode]
    src = runs[mode] / "checkpoints" / f"step_{every}"
    shutil.copytree(src, tmp_path / "checkpoints" / f"step_{every}")
    proc = launch("torchrun", BASE + extra + ["checkpoint.resume=auto", "checkpoint.at_end=false"], tmp_path,
                  nproc=2)
    ok(proc)
    assert "starts afresh" not in proc.stdout and "no state of this worker" not in proc.stdout
    ref = {r["step"]: r for r in metrics(runs[mode])}
    got = metrics(tmp_path)
    assert [r["step"] for r in got] == list(range(every + 1, 9))
    assert [(r["loss"], r["grad_norm"], r["comm_bytes"]) for r in got] == \
        [(ref[r["step"]]["loss"], ref[r["step"]]["grad_norm"], ref[r["step"]]["comm_bytes"]) for r in got]


def test_fsdp_bytes_follow_the_gathers_and_reductions(tmp_path, runs, shapes):
    """FSDP2 on 2 ranks, accumulation 2: each micro-batch all-gathers the parameters for forward and again for
    backward (reshard_after_forward) and reduce-scatters the gradient; the norm is one fp64 all-reduce."""
    ok(launch("torchrun", SMALL + ["strategy=fsdp", "train.max_steps=2", "train.log_every=1",
                                   "train.global_batch_size=8", "train.micro_batch_size=2", "eval.every=0",
                                   "eval.at_end=false", "export.hf_at_end=false", "checkpoint.at_end=false",
                                   "logging.comm_bytes=true"],
              tmp_path, nproc=2))
    full = 4 * sum(_numel(s) for s in shapes.values())
    for rec in metrics(tmp_path):
        assert rec["comm_bytes_by_kind"] == {"all_gather": 2 * 2 * full, "reduce_scatter": 2 * full,
                                             "all_reduce": 8}, rec


def test_the_checkpoint_model_is_worker_0s_inside_a_round(runs):
    """Mid-round the workers' weights differ; the checkpoint's shared model tensors are worker 0's whole model
    (DCP writes each name from the lowest rank holding it), not a mix of workers per tensor."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = runs["diloco_h4"] / "checkpoints" / "step_6"
    dcp_to_torch_save(ckpt, ckpt.parent / "flat.pt")
    model = torch.load(ckpt.parent / "flat.pt", weights_only=True)["model"]
    workers = [torch.load(ckpt / "local" / f"rank_{r}.pt", weights_only=True)["weights"] for r in (0, 1)]
    assert all(torch.equal(model[n], t) for n, t in workers[0].items())
    assert not all(torch.equal(model[n], t) for n, t in workers[1].items())


# hsdp, 4 ranks: 2 replica groups (the workers) of 2 shards each; SGD, 4 steps
HSDP = [o for o in BASE if not o.startswith(("strategy=", "train.max_steps"))] + [
    "strategy=hsdp", "strategy.dp_replicate=2", "strategy.dp_shard=2", "train.max_steps=4"]


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory):
    out = {}
    for mode, extra in (("every_step", ["checkpoint.at_end=false"]),
                        ("local_sgd_h1", ["sync=local_sgd", "sync.every=1", "checkpoint.at_end=false"]),
                        ("diloco_h2", ["sync=diloco", "sync.every=2", "optim=adamw", "optim.lr=0.003",
                                       "checkpoint.every=3"])):
        out[mode] = tmp_path_factory.mktemp(f"hsdp_{mode}")
        ok(launch("torchrun", HSDP + extra, out[mode], nproc=4))
    return out


def test_hsdp_local_sgd_every_step_is_hsdp(hsdp_runs, shapes):
    """Each replica group is a worker, sharded inside: with SGD and sync.every=1 the averaged shards are
    synchronous hsdp's. Bytes: the group's gathers and reduce-scatters, the norm over the group, and once per step
    the all-reduce of rank 0's shards (FSDP2 gives rank 0 the first ceil(rows / 2) rows of each tensor)."""
    ref, local = metrics(hsdp_runs["every_step"]), metrics(hsdp_runs["local_sgd_h1"])
    loss_err = max(rel_err(a["loss"], b["loss"]) for a, b in zip(local, ref))
    print(f"hsdp local SGD, sync.every=1, vs hsdp (SGD): max relative loss error {loss_err:.2e}")
    assert len(local) == 4 and loss_err < FP32_TOL
    full = 4 * sum(_numel(s) for s in shapes.values())
    shard0 = 4 * sum(-(-s[0] // 2) * _numel(s[1:]) for s in shapes.values())
    for rec in local:
        # one micro-batch per rank (8 sequences, 2 per micro-batch, 4 ranks): gathered for forward and backward
        assert rec["comm_bytes_by_kind"] == {"all_gather": 2 * full, "reduce_scatter": full,
                                             "all_reduce": shard0 + 8}, rec


def test_hsdp_diloco_resumes_exactly(hsdp_runs, tmp_path):
    run = hsdp_runs["diloco_h2"]
    shutil.copytree(run / "checkpoints" / "step_3", tmp_path / "checkpoints" / "step_3")
    extra = ["sync=diloco", "sync.every=2", "optim=adamw", "optim.lr=0.003", "checkpoint.resume=auto",
             "checkpoint.at_end=false"]
    proc = launch("torchrun", HSDP + extra, tmp_path, nproc=4)
    ok(proc)
    assert "no state of this worker" not in proc.stdout
    ref = metrics(run)
    assert ref[-1]["loss"] < ref[0]["loss"]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(tmp_path)] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in ref[3:]]
