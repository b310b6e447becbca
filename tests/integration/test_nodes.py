"""Several nodes without a scheduler, as two launches of launch.sh on this machine (NNODES=2, NODE_RANK 0 and 1,
one rank each, the master on loopback): torchrun's static rendezvous and the deepspeed launcher (one per node, no
ssh) train the same numbers as one node at world size 2. Before the first step the nodes check that they share
the run directory (a node with a private file system at the same path is refused) and run the same config."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from tests.integration.conftest import FP32_TOL, REPO, SMALL, curve_errors, free_port, launch, metrics, ok

RUN = SMALL + ["train.max_steps=6", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2",
               "eval.every=0", "eval.at_end=false", "export.hf_at_end=false", "checkpoint.at_end=false"]


def two_nodes(args: List[str], node1_prefix: List[str] = (), node1_args: List[str] = (), timeout: float = 300):
    """launch.sh on node 0 and node 1 (same machine, MASTER_ADDR=127.0.0.1) -> their CompletedProcesses."""
    port = str(free_port())
    procs = []
    for node in (0, 1):
        env = dict(os.environ, NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   TESSERA_VENV=str(Path(sys.executable).parent.parent))
        cmd = [str(REPO / "launch.sh"), *args, *(node1_args if node == 1 else [])]
        if node == 1:
            cmd = [*node1_prefix, *cmd]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise AssertionError(f"two nodes still running after {timeout}s (a hang?)")
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one-node")
    ok(launch("torchrun", RUN + ["strategy=ddp"], run_dir, nproc=2))
    return metrics(run_dir)


@pytest.mark.parametrize("strategy,launcher", [("ddp", "torchrun"), ("zero2", "DeepSpeed's launch.py")])
def test_two_nodes_on_loopback_train_like_one_node(one_node, tmp_path, strategy, launcher):
    nodes = two_nodes(RUN + [f"strategy={strategy}", f"hydra.run.dir={tmp_path}"])
    for node, proc in enumerate(nodes):
        assert proc.returncode == 0, f"node {node}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    assert "world 2 (dp 2)" in nodes[0].stdout + nodes[0].stderr
    loss_err, norm_err = curve_errors(metrics(tmp_path), one_node, same_steps=True)
    print(f"{strategy} ({launcher}) on two nodes vs one node (ws2): max relative loss error {loss_err:.2e}, "
          f"grad-norm error {norm_err:.2e}")
    assert loss_err < FP32_TOL and norm_err < FP32_TOL, (loss_err, norm_err)
    assert not (tmp_path / ".node-probes").exists()  # the shared-folder probes are cleaned up


def _one_message(nodes, needle: str) -> None:
    """Both nodes end with exit 2 and one message, without a traceback: rank 0's node prints it; the other node
    prints it too when rank 0's exit did not reach it first (each node's own log then says why it stopped)."""
    text = "".join(p.stdout + p.stderr for p in nodes)
    assert [p.returncode for p in nodes] == [2, 2], text[-4000:]
    counts = [(p.stdout + p.stderr).count(needle) for p in nodes]
    assert counts[0] == 1 and counts[1] <= 1 and "Traceback" not in text, text[-4000:]


def test_a_run_directory_the_nodes_do_not_share_is_refused(tmp_path):
    """Node 1 runs in a mount namespace of its own with a private tmpfs at the run directory's parent: the same
    path, another file system (as a node-local disk would be)."""
    parent = tmp_path / "runs"
    parent.mkdir()
    private = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs none "{parent}" && exec "$0" "$@"']
    nodes = two_nodes(RUN + ["strategy=ddp", f"hydra.run.dir={parent / 'run'}"], node1_prefix=private)
    _one_message(nodes, f"the run directory {parent / 'run'} is not shared by the nodes")
    assert not (parent / "run" / "metrics.jsonl").exists()


def test_nodes_with_different_configs_are_refused(tmp_path):
    nodes = two_nodes(RUN + ["strategy=ddp", f"hydra.run.dir={tmp_path}"], node1_args=["optim.lr=0.5"])
    _one_message(nodes, "runs another config than rank 0: optim.lr=0.5 (rank 0: 0.001)")
