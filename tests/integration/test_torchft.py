"""torchft replica groups (strategy.fault_tolerance=torchft): real torchrun jobs, one per group, coordinated by a
real torchft lighthouse.

- With every group present, the groups train exactly like DDP over all their ranks (launch.sh's launcher).
- One group dies (its torchrun agent and ranks SIGKILLed from outside): the other trains on without a restart,
  its steps normalised by the tokens it trained; the group comes back, copies the live group's state and
  rejoins; at the end both groups hold the same weights and optimizer state, bit for bit. For DDP groups
  (1 rank) and FSDP2 groups (2 ranks sharding the model).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.integration.conftest import (FP32_TOL, REPO, SMALL, checkpoint_tensors, curve_errors, descendants, launch,
                                        metrics, ok, read_jsonl, rel_err, run_process_group, wait_while_running)

pytest.importorskip("torchft", reason="torchft publishes wheels for Linux x86_64 only")

MAIN = REPO / "trainer" / "main.py"
FAULT_WORKER = REPO / "tests" / "integration" / "fault_worker.py"
ARGS = SMALL + ["train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every=1", "eval.every=0",
                "eval.at_end=false", "export.hf_at_end=false"]
# strategy -> (ranks per group, overrides): DDP groups of one rank; FSDP2 groups of two ranks sharding the model.
LAYOUTS = {"ddp": (1, ["strategy=ddp"]),
           "hsdp": (2, ["strategy=hsdp", "strategy.dp_shard=2", "train.micro_batch_size=1"])}
# The step after which group 1 is killed (checkpoints every 10): ddp's group comes back from its own step-10
# checkpoint, then catches up from the live group; hsdp's has no checkpoint and starts with an empty optimizer,
# which the live group's state fills (DTensor shards).
KILL_AFTER = {"ddp": 12, "hsdp": 6}
TORCHFT = ["strategy.fault_tolerance=torchft", "strategy.replica_groups=2"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replica_groups_train_like_one_job_over_all_their_ranks(tmp_path, layout):
    """2 groups against the same strategy on all their ranks in one job, through launch.sh's launcher (it starts
    the lighthouse). ddp, 2 x 1 rank: every logged loss and gradient norm equal (the same two-way fp32 sums, the
    token scale exactly 1); hsdp, 2 x 2 ranks sharding: within fp32 reordering (FP32_TOL)."""
    nproc, layout_args = LAYOUTS[layout]
    args = ARGS + layout_args + ["train.max_steps=8"]
    ok(launch("torchrun", args, tmp_path / "one-job", nproc=2 * nproc))
    reference = metrics(tmp_path / "one-job")
    cmd = [sys.executable, "-m", "trainer.torchft_launch", "--nproc_per_node", str(nproc), str(MAIN)] + args + \
        TORCHFT + ["strategy.min_replica_groups=2", f"hydra.run.dir={tmp_path / 'ft'}"]
    proc = run_process_group(cmd, env=_env(), timeout=300)
    ok(proc)
    assert "torchft lighthouse at http://127.0.0.1:" in proc.stderr
    for g in (0, 1):
        recs = metrics(tmp_path / "ft" / f"replica_group_{g}")
        assert [r["step"] for r in recs] == list(range(1, 9))
        assert all(r["replica_groups"] == 2 for r in recs)
        assert [r["tokens"] for r in recs] == [r["tokens"] for r in reference]
        if layout == "ddp":
            assert [(r["loss"], r["grad_norm"]) for r in recs] == [(r["loss"], r["grad_norm"]) for r in reference]
        else:
            assert max(curve_errors(recs, reference, same_steps=True)) <= FP32_TOL


def _group(run_dir, g: int, lighthouse: str, steps: int, log, layout: str):
    nproc, layout_args = LAYOUTS[layout]
    cmd = [sys.executable, "-m", "trainer.torchrun", "--standalone", f"--nproc_per_node={nproc}", str(FAULT_WORKER),
           "--step-delay=0.15"] + ARGS + layout_args + TORCHFT + \
        [f"strategy.replica_group={g}", f"strategy.lighthouse={lighthouse}", f"train.max_steps={steps}",
         "checkpoint.every=10", "checkpoint.resume=auto", f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _records(run_dir, g: int) -> list:
    path = run_dir / f"replica_group_{g}" / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_replica_group_dies_the_other_trains_on_and_it_rejoins(tmp_path, layout):
    from trainer.torchft_launch import start_lighthouse

    steps = 90
    lighthouse, address = start_lighthouse(1)
    run_dir = tmp_path / "run"
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("g0", "g1", "g1-again")}
    g0 = _group(run_dir, 0, address, steps, logs["g0"], layout)
    g1 = _group(run_dir, 1, address, steps, logs["g1"], layout)
    procs = [g0, g1]
    try:
        wait_while_running(lambda: len(_records(run_dir, 0)) >= KILL_AFTER[layout], "the step to kill at", procs)
        t_lost = time.time()
        for pid in [g1.pid] + descendants(g1.pid):  # the group is gone: its torchrun agent and its rank
            os.kill(pid, signal.SIGKILL)
        g1.wait()
        procs = [g0]
        wait_while_running(lambda: sum(r["replica_groups"] == 1 for r in _records(run_dir, 0)) >= 8, "8 steps of group 0 alone",
              procs)
        t_alone = next(r["time"] for r in _records(run_dir, 0) if r["replica_groups"] == 1)
        g1 = _group(run_dir, 1, address, steps, logs["g1-again"], layout)
        procs = [g0, g1]
        alone = sum(r["replica_groups"] == 1 for r in _records(run_dir, 0))
        wait_while_running(lambda: any(r["replica_groups"] == 2 for r in _records(run_dir, 0)[alone + 12:]),
              "group 1 to rejoin", procs)
        assert g0.wait(timeout=300) == 0, (tmp_path / "g0.log").read_text()[-3000:]
        assert g1.wait(timeout=300) == 0, (tmp_path / "g1-again.log").read_text()[-3000:]
    finally:
        for p in (g0, g1):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        lighthouse.kill()
        for fh in logs.values():
            fh.close()

    recs = _records(run_dir, 0)
    assert [r["step"] for r in recs] == list(range(1, steps + 1)), "one record per step, none repeated or missing"
    groups = [r["replica_groups"] for r in recs]
    down = [r for r in recs if r["replica_groups"] == 1]
    first_down, last_down = down[0]["step"], down[-1]["step"]
    # Two groups, then group 0 alone (no restart of group 0: one launch, steps advancing), then two again.
    assert set(groups[:first_down - 1]) == {2} and set(groups[last_down:]) == {2}
    assert all(g == 1 for g in groups[first_down - 1:last_down]), groups
    # While alone, group 0 trains on its half of each global batch: the step's tokens are its share only.
    full = [b["tokens"] - a["tokens"] for a, b in zip(recs, recs[1:]) if a["replica_groups"] == b["replica_groups"] == 2]
    half = [b["tokens"] - a["tokens"] for a, b in zip(recs, recs[1:]) if b["replica_groups"] == 1 and a["step"] >= first_down]
    assert max(half) < min(full) and 0.3 < sum(half) / len(half) / (sum(full) / len(full)) < 0.7
    log_again = (tmp_path / "g1-again.log").read_text()
    assert "recovered from a live group" in log_again, log_again[-3000:]
    # After recovery both groups take the same steps from the same state: identical at the end, bit for bit.
    got = checkpoint_tensors(run_dir / "replica_group_1" / "checkpoints" / f"step_{steps}")
    want = checkpoint_tensors(run_dir / "replica_group_0" / "checkpoints" / f"step_{steps}")
    assert got.keys() == want.keys() and len(want) > 10
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    rejoined = next(r["step"] for r in recs if r["step"] > last_down)
    print(f"\ntorchft {layout}: group 1 lost after step {KILL_AFTER[layout]}; group 0 alone for steps {first_down}..{last_down} "
          f"({len(down)} steps, first {t_alone - t_lost:.1f} s after the loss); both again from step {rejoined}; "
          f"mean tokens/step alone {sum(half) / len(half):.0f} vs {sum(full) / len(full):.0f} with both; final "
          f"checkpoints of the two groups equal ({len(want)} tensors); loss at step {steps} "
          f"{recs[-1]['loss']:.4f} (rel to group 1's {rel_err(recs[-1]['loss'], _records(run_dir, 1)[-1]['loss']):.1e})")
