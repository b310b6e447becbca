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
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import (FP32_TOL, REPO, SMALL, checkpoint_tensors, curve_errors, descendants, launch,
                                        metrics, ok, read_jsonl, run_process_group, wait_while_running)

pytest.importorskip("torchft", reason="torchft publishes wheels for Linux x86_64 only")

FAULT_WORKER = REPO / "tests" / "integration" / "fault_worker.py"
ARGS = SMALL + ["train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every=1", "eval.every=0",
                "eval.at_end=false", "export.hf_at_end=false"]
# strategy -> (ranks per group, overrides): DDP groups of one rank; FSDP2 groups of two ranks sharding the model.
LAYOUTS = {"ddp": (1, ["strategy=ddp"]),
           "hsdp": (2, ["strategy=hsdp", "strategy.dp_shard=2", "train.micro_batch_size=1"])}
# How group 1 fails, after which step (checkpoints every 10):
# - ddp: its rank is SIGKILLed; its torchrun (launch.sh's, with train.max_restarts) starts it again; it resumes
#   its own step-10 checkpoint, then catches up from the live group;
# - hsdp: the whole group goes (its torchrun and both ranks, as when its node is lost) and is started again by
#   hand; it has no checkpoint yet, so its empty optimizer is filled from the live group's (DTensor shards).
FAULTS = {"ddp": ("rank", 12), "hsdp": ("node", 6)}
TORCHFT = ["strategy.fault_tolerance=torchft", "strategy.replica_groups=2"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replica_groups_train_like_one_job_over_all_their_ranks(tmp_path, layout):
    """2 groups against the same strategy on all their ranks in one job, through launch.sh (it starts the lighthouse and
    both groups). ddp, 2 x 1 rank: every logged loss and gradient norm equal (the same two-way fp32 sums, the token
    scale exactly 1); hsdp, 2 x 2 ranks sharding: within fp32 reordering (FP32_TOL)."""
    nproc, layout_args = LAYOUTS[layout]
    args = ARGS + layout_args + ["train.max_steps=8"]
    ok(launch("torchrun", args, tmp_path / "one-job", nproc=2 * nproc))
    reference = metrics(tmp_path / "one-job")
    cmd = [str(REPO / "launch.sh")] + args + TORCHFT + ["strategy.min_replica_groups=2",
                                                        f"hydra.run.dir={tmp_path / 'ft'}"]
    env = dict(_env(), NPROC_PER_NODE=str(nproc), TESSERA_VENV=str(Path(sys.executable).parent.parent))
    proc = run_process_group(cmd, env=env, timeout=300)
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
            errors = curve_errors(recs, reference, same_steps=True)
            print(f"\ntorchft hsdp group {g}: max relative loss error {errors[0]:.1e}, grad norm {errors[1]:.1e}")
            assert max(errors) <= FP32_TOL


def _group(run_dir, g: int, lighthouse: str, steps: int, log, layout: str, extra=()):
    nproc, layout_args = LAYOUTS[layout]
    cmd = [sys.executable, "-m", "trainer.torchrun", "--standalone", f"--nproc_per_node={nproc}", str(FAULT_WORKER),
           "--step-delay=0.15"] + ARGS + layout_args + TORCHFT + \
        [f"strategy.replica_group={g}", f"strategy.lighthouse={lighthouse}", f"train.max_steps={steps}",
         "checkpoint.every=10", "checkpoint.resume=auto", f"hydra.run.dir={run_dir}", *extra]
    env = dict(_env(), TESSERA_MAX_RESTARTS="2")  # as launch.sh exports train.max_restarts
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _records(run_dir, g: int) -> list:
    path = run_dir / f"replica_group_{g}" / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


def _alone(run_dir) -> int:
    return sum(r["replica_groups"] == 1 for r in _records(run_dir, 0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_replica_group_dies_the_other_trains_on_and_it_rejoins(tmp_path, layout):
    from trainer.launch.torchft import start_lighthouse

    steps, (how, kill_after) = 120, FAULTS[layout]
    lighthouse, address = start_lighthouse(1)
    run_dir = tmp_path / "run"
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("g0", "g1", "g1-again")}
    g0 = _group(run_dir, 0, address, steps, logs["g0"], layout)
    g1 = _group(run_dir, 1, address, steps, logs["g1"], layout)
    procs = [g0, g1]
    try:
        wait_while_running(lambda: len(_records(run_dir, 0)) >= kill_after, "the step to kill at", procs)
        t_lost = time.time()
        if how == "rank":  # the rank only: its torchrun restarts it (group 0 may or may not see a step alone: a
            # restart that beats the lighthouse's heartbeat timeout joins the very next quorum)
            for pid in descendants(g1.pid):
                os.kill(pid, signal.SIGKILL)
            wait_while_running(lambda: "recovered from a live group" in (tmp_path / "g1.log").read_text(),
                               "group 1 to recover", procs)
        else:  # the group's node: its torchrun agent and its ranks at once; back by hand later
            for pid in [g1.pid] + descendants(g1.pid):
                os.kill(pid, signal.SIGKILL)
            g1.wait()
            procs = [g0]
            wait_while_running(lambda: _alone(run_dir) >= 3, "3 steps of group 0 alone", procs)
            g1 = _group(run_dir, 1, address, steps, logs["g1-again"], layout)
            procs = [g0, g1]
            wait_while_running(lambda: "recovered from a live group" in (tmp_path / "g1-again.log").read_text(),
                               "group 1 to recover", procs)
        assert g0.wait(timeout=300) == 0, (tmp_path / "g0.log").read_text()[-3000:]
        assert g1.wait(timeout=300) == 0, (tmp_path / f"g1{'' if how == 'rank' else '-again'}.log").read_text()[-3000:]
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
    down = [r["step"] for r in recs if r["replica_groups"] == 1]
    # Two groups, then group 0 alone (not restarted: one launch, its steps advancing), then two again.
    first, last = (down[0], down[-1]) if down else (kill_after + 1, kill_after)
    assert groups == [2] * (first - 1) + [1] * (last - first + 1) + [2] * (steps - last), groups
    if how == "node":  # kept down until group 0 had trained 3 steps alone
        assert len(down) >= 3
    delta = {b["step"]: b["tokens"] - a["tokens"] for a, b in zip(recs, recs[1:])}
    full = [v for k, v in delta.items() if k not in down]
    alone = [delta[k] for k in down if k in delta] or [0]
    if down:  # alone, group 0 trains on its share of each global batch only: about half the tokens of a step
        assert max(alone) < min(full) and 0.3 < (sum(alone) / len(alone)) / (sum(full) / len(full)) < 0.7
    t_alone = recs[first - 1]["time"] if down else float("nan")
    back_log = (tmp_path / ("g1.log" if how == "rank" else "g1-again.log")).read_text()
    assert "recovered from a live group" in back_log, back_log[-3000:]
    if how == "rank":
        assert "restarting the ranks (1 of 2)" in back_log, back_log[-3000:]
    # After recovery both groups take the same steps from the same state: identical at the end, bit for bit.
    got = checkpoint_tensors(run_dir / "replica_group_1" / "checkpoints" / f"step_{steps}")
    want = checkpoint_tensors(run_dir / "replica_group_0" / "checkpoints" / f"step_{steps}")
    assert got.keys() == want.keys() and len(want) > 10
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    alone_desc = (f"group 0 trained alone for {len(down)} steps ({first}..{last}; the first logged "
                  f"{t_alone - t_lost:.1f} s after the kill; tokens per step {sum(alone) / len(alone):.0f} vs "
                  f"{sum(full) / len(full):.0f})" if down else "group 1 was back before group 0's next quorum")
    print(f"\ntorchft {layout}: group 1's {how} killed after step {kill_after}; {alone_desc}; both groups from step "
          f"{last + 1}; the groups' final checkpoints equal ({len(want)} tensors); final loss {recs[-1]['loss']:.4f}")


def test_a_group_of_another_run_is_refused_and_the_live_group_trains_on(tmp_path):
    """A group started with another global batch would copy state it cannot continue: it is refused with the
    resume checks' message (exit 2, not restarted) before any of its state is overwritten."""
    from trainer.launch.torchft import start_lighthouse

    lighthouse, address = start_lighthouse(1)
    run_dir = tmp_path / "run"
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("g0", "g1")}
    g0 = _group(run_dir, 0, address, 2000, logs["g0"], "ddp")  # trains until the test stops it
    g1 = None
    try:
        wait_while_running(lambda: len(_records(run_dir, 0)) >= 3, "group 0's third step", [g0])
        g1 = _group(run_dir, 1, address, 2000, logs["g1"], "ddp", extra=["train.global_batch_size=16"])
        assert g1.wait(timeout=240) == 2
        steps = len(_records(run_dir, 0))
        wait_while_running(lambda: len(_records(run_dir, 0)) >= steps + 3, "group 0 to train on", [g0])
        os.kill(g0.pid, signal.SIGTERM)  # stops after a step, with a checkpoint
        assert g0.wait(timeout=240) == 0, (tmp_path / "g0.log").read_text()[-3000:]
    finally:
        for p in (g0, g1):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        lighthouse.kill()
        for fh in logs.values():
            fh.close()
    out = (tmp_path / "g1.log").read_text()
    assert "this replica group cannot take the live groups' state (they train another run)" in out, out[-3000:]
    assert "train.global_batch_size=16 but the checkpoint was saved with 8" in out, out[-3000:]
    assert "Traceback" not in out and "restarting the ranks" not in out, out[-3000:]
    recs = _records(run_dir, 0)
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1)) and all(r["replica_groups"] == 1 for r in recs)

