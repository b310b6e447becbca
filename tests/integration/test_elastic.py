"""Elastic membership: two torchrun agents on loopback stand for two nodes (`--nnodes=1:2`, c10d rendezvous,
one rank each). One node dies (its agent and rank SIGKILLed): the other re-forms the job at world size 1 and
continues from the last checkpoint with the same global batch (accumulation 2 -> 4); the node comes back: the job
grows to world size 2 again (the running rank stops after a step with a checkpoint and the two continue from it).
The loss of every step matches a fixed-size run within 1e-5 relative, one record per step."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.integration.conftest import (REPO, SMALL, descendants, free_port, launch, metrics, ok, rel_err,
                                        wait_while_running)

STEPS = 120
ARGS = SMALL + ["data.embedded_documents=400", "train.global_batch_size=8", "train.micro_batch_size=2",
                "train.log_every=1", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false",
                f"train.max_steps={STEPS}", "checkpoint.every=5", "strategy=ddp"]
RDZV_CONF = "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def _agent(run_dir, port: int, log):
    """One "node": the elastic launch line of docs/fault-tolerance.md (launch.sh runs the same with NNODES=1:2)."""
    cmd = [sys.executable, "-m", "trainer.torchrun", "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=3",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
           f"--rdzv-conf={RDZV_CONF}", str(REPO / "trainer" / "main.py")] + ARGS + \
        ["checkpoint.resume=auto", f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _steps(run_dir) -> list:
    return [r["step"] for r in metrics(run_dir)] if (run_dir / "metrics.jsonl").exists() else []


def test_a_node_leaves_and_comes_back(tmp_path):
    reference = tmp_path / "fixed"
    ok(launch("torchrun", ARGS, reference, nproc=2, timeout=300))
    run_dir, port = tmp_path / "elastic", free_port()
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("a", "b", "b2")}
    a = _agent(run_dir, port, logs["a"])
    time.sleep(1.0)  # a hosts the rendezvous store
    b = _agent(run_dir, port, logs["b"])
    b2 = None
    procs = [a, b]
    try:
        wait_while_running(lambda: len(_steps(run_dir)) >= 12, "step 12 at world size 2", procs)
        t_lost = time.time()
        for pid in [b.pid] + descendants(b.pid):  # the node is gone: its agent and its rank at once
            os.kill(pid, signal.SIGKILL)
        b.wait()
        procs = [a]
        a_log = tmp_path / "a.log"
        wait_while_running(lambda: "world 1 (dp 1)" in a_log.read_text(), "the job to re-form at world size 1", procs)
        t_shrunk = time.time()
        resumed = _steps(run_dir)[-1]
        wait_while_running(lambda: _steps(run_dir)[-1] >= resumed + 3, "steps at world size 1", procs)
        b2 = _agent(run_dir, port, logs["b2"])
        procs = [a, b2]
        wait_while_running(lambda: a_log.read_text().count("world 2 (dp 2)") >= 2, "the job to grow to world size 2", procs)
        t_grown = time.time()
        a.wait(timeout=300)
        b2.wait(timeout=300)
    finally:
        for p in (a, b, b2):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for fh in logs.values():
            fh.close()
    a_out = (tmp_path / "a.log").read_text()
    assert a.returncode == 0 and b2.returncode == 0, a_out[-4000:] + (tmp_path / "b2.log").read_text()[-2000:]
    assert "saved at world size 2, now 1" in a_out and "saved at world size 1, now 2" in a_out
    assert "accumulation 4 x dp 1" in a_out and "accumulation 2 x dp 2" in a_out
    assert _steps(run_dir) == list(range(1, STEPS + 1))  # one series, no step twice
    got = {r["step"]: r["loss"] for r in metrics(run_dir)}
    ref = {r["step"]: r["loss"] for r in metrics(reference)}
    worst = max(rel_err(got[s], ref[s]) for s in ref)
    print(f"elastic: re-formed at world size 1 {t_shrunk - t_lost:.1f} s after the node was lost, grown to "
          f"world size 2 {t_grown - t_shrunk:.1f} s later; max relative loss error vs fixed size {worst:.2e}")
    assert worst < 1e-5
