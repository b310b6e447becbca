"""SLURM, on a real two-node cluster on this machine (tests/slurm_cluster.py: slurmctld and two slurmd daemons,
installed with apt where missing): `sbatch -N 2 launch.sh` (torchrun on each node) and `srun launch.sh` inside an
allocation (the deepspeed launcher on each node) train the same numbers as one node at the same world size; a
requeued job stops with a checkpoint and continues from it; Hydra's submitit launcher runs a sweep on the
cluster; allocations launch.sh cannot run in end with one message (exit 2)."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import FP32_TOL, REPO, SMALL, curve_errors, launch, metrics, ok, read_jsonl
from tests.slurm_cluster import SlurmCluster

LAUNCH_SH = str(REPO / "launch.sh")
RUN = SMALL + ["train.max_steps=6", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2",
               "eval.every=0", "eval.at_end=false", "export.hf_at_end=false", "checkpoint.at_end=false"]
# launch.sh's environment on each node: one rank per node (world size 2 over the two nodes)
NODE_ENV = {"NPROC_PER_NODE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "TESSERA_VENV": str(Path(sys.executable).parent.parent)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """ddp on one node at world size 2: the numbers every two-node run must give."""
    run_dir = tmp_path_factory.mktemp("one-node")
    ok(launch("torchrun", RUN + ["strategy=ddp"], run_dir, nproc=2))
    return metrics(run_dir)


def _output(path: Path) -> str:
    return path.read_text() if path.exists() else "(no output)"


def test_sbatch_and_srun_on_two_nodes_train_like_one_node(cluster, one_node, tmp_path):
    """ddp through `sbatch -N 2 launch.sh` (launch.sh finds its repository from slurmd's spool copy, starts itself
    once per node with srun; torchrun on each node) and zero2 through `salloc -N 2 srun launch.sh` (the deepspeed
    launcher on each node, given a hostfile of the allocation's nodes): both equal one node at world size 2."""
    ddp_out = tmp_path / "ddp.out"
    job = cluster.sbatch(["-N", "2", "-o", str(ddp_out), LAUNCH_SH, *RUN, "strategy=ddp",
                          f"hydra.run.dir={tmp_path / 'ddp'}"], env_extra=NODE_ENV, cwd=tmp_path)
    zero2 = subprocess.run(["salloc", "-N", "2", "srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", LAUNCH_SH, *RUN, "strategy=zero2",
                            f"hydra.run.dir={tmp_path / 'zero2'}"], env=cluster.env(**NODE_ENV), cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert zero2.returncode == 0, zero2.stdout[-3000:] + zero2.stderr[-3000:]
    assert cluster.wait(job) == "COMPLETED", _output(ddp_out)[-4000:]
    assert cluster.job_field(job, "NodeList") == "n[1-2]"
    for name, text in (("ddp", _output(ddp_out)), ("zero2", zero2.stdout + zero2.stderr)):
        assert "world 2 (dp 2)" in text, text[-3000:]
        loss_err, norm_err = curve_errors(metrics(tmp_path / name), one_node, same_steps=True)
        print(f"{name} on 2 SLURM nodes vs one node (ws2): max relative loss error {loss_err:.2e}, grad-norm error "
              f"{norm_err:.2e}")
        assert loss_err < FP32_TOL and norm_err < FP32_TOL, (name, loss_err, norm_err)
    assert "nnodes=2" in zero2.stdout + zero2.stderr  # DeepSpeed's launch.py on two nodes


def test_allocations_launch_sh_cannot_run_in_are_refused(cluster, tmp_path):
    """Two tasks per node (launch.sh starts a node's ranks itself) and NNODES that is not the allocation's: one
    message each, exit code 2, before anything trains."""
    env = cluster.env(**NODE_ENV)
    many = subprocess.run(["salloc", "-N", "2", "--ntasks-per-node=2", "srun", LAUNCH_SH, *RUN, "strategy=ddp",
                           f"hydra.run.dir={tmp_path / 'many'}"], env=env, capture_output=True, text=True, timeout=200)
    assert many.returncode != 0
    assert "must run once per node" in many.stderr and "Traceback" not in many.stderr, many.stderr[-2000:]
    out = tmp_path / "nnodes.out"
    job = cluster.sbatch(["-N", "2", "-o", str(out), LAUNCH_SH, *RUN, f"hydra.run.dir={tmp_path / 'nnodes'}"],
                         env_extra=dict(NODE_ENV, NNODES="3"), cwd=tmp_path)
    assert cluster.wait(job) == "FAILED"
    assert cluster.job_field(job, "ExitCode").startswith("2:"), _output(out)
    text = _output(out)
    assert "NNODES=3 but the SLURM allocation has 2 node(s)" in text and "Traceback" not in text, text
    assert not (tmp_path / "many").exists() and not (tmp_path / "nnodes").exists()


def _wait_for(predicate, timeout: float, what: str, log: Path):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n{_output(log)[-3000:]}")


def test_a_requeued_job_stops_with_a_checkpoint_and_continues_from_it(cluster, tmp_path):
    """`scontrol requeue` ends the running job as SLURM ends any job (SIGTERM to every process of it): every rank
    stops after the same step with a checkpoint; the requeued job (SLURM_RESTART_COUNT=1) continues from that
    checkpoint in the same run directory and finishes the run, each step logged once."""
    steps = 200
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = cluster.sbatch(["-N", "2", "--requeue", "-o", str(out), "--open-mode=append", LAUNCH_SH,
                          *SMALL, f"train.max_steps={steps}", "train.log_every=1", "train.global_batch_size=8",
                          "train.micro_batch_size=2", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false",
                          "strategy=ddp", f"hydra.run.dir={run_dir}"], env_extra=NODE_ENV, cwd=tmp_path)
    _wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 5 if (run_dir / "metrics.jsonl").exists()
              else False, 240, "5 logged steps", out)
    requeue = subprocess.run(["scontrol", "requeue", job], env=cluster.env(), capture_output=True, text=True)
    assert requeue.returncode == 0, requeue.stderr
    assert cluster.wait(job, timeout=400) == "COMPLETED", _output(out)[-4000:]
    text = _output(out)
    stop = re.search(r"stopped by SIGTERM at step (\d+)", text)
    assert stop, text[-4000:]
    stopped_at = int(stop.group(1))
    assert stopped_at < steps and f"resumed from {run_dir / 'checkpoints' / f'step_{stopped_at}'}" in text, text[-4000:]
    assert cluster.job_field(job, "Restarts") == "1"
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, steps + 1))
    print(f"requeued at step {stopped_at}, continued to {steps}")


def test_hydra_submitit_launcher_runs_a_sweep_on_the_cluster(cluster, tmp_path):
    """`-m hydra/launcher=submitit_slurm`: each point of the sweep is a SLURM job with a run directory of its own
    under hydra.sweep.dir; the two learning rates give two different curves, each from step 1."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, str(REPO / "trainer" / "main.py"), "-m", "hydra/launcher=submitit_slurm",
                           "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=10", "strategy=single",
                           *RUN, "optim.lr=1e-3,3e-4", f"hydra.sweep.dir={sweep}"],
                          env=cluster.env(OMP_NUM_THREADS="1"), cwd=tmp_path, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    curves = [metrics(sweep / str(i)) for i in range(2)]
    assert [[r["step"] for r in c] for c in curves] == [list(range(1, 7))] * 2
    assert [c[0]["lr"] for c in curves] == pytest.approx([1e-3, 3e-4])  # the peak after one warm-up step
    assert curves[0][0]["loss"] == curves[1][0]["loss"] and curves[0][-1]["loss"] != curves[1][-1]["loss"]
