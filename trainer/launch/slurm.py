"""SLURM: what launch.sh needs inside an allocation, from SLURM's own environment and `scontrol`.

    python -m trainer.launch.slurm step      # the batch script: srun's options that start one task per node
    python -m trainer.launch.slurm node      # one task per node: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT

`sbatch -N 2 launch.sh <overrides>` runs launch.sh once, on the first node, from a copy in slurmd's spool: launch.sh
finds the repository from the job's command (in bash: no environment is known yet), then starts itself once per
node with srun. Each task derives the
node count, its node rank, the master's address (the first node of the step, resolved through SLURM's NodeAddr)
and a port every node computes alike from the job id; torchrun or the deepspeed launcher then start the node's
ranks. `srun launch.sh ...` inside an allocation (salloc, or a batch script of the user's own) starts at the
`node` stage directly. Bad allocations end with one message and exit code 2. This module imports no torch (it
runs before every launch)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from typing import Dict, List, Mapping, Optional

from tessera.errors import EXIT_BAD_INPUT, TesseraError, one_line

# MASTER_PORT under SLURM: every node computes the same one from the job id; distinct jobs sharing a node get
# distinct ports (unless their ids are PORT_SPAN apart and they share the first node).
PORT_BASE, PORT_SPAN = 20000, 10000


class SlurmError(TesseraError):
    """An allocation launch.sh cannot run in, or SLURM's tools failing: one message, exit code 2."""

    same_on_every_rank = True


def scontrol(*args: str) -> str:
    try:
        proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"`scontrol {' '.join(args)}` failed: {one_line(e)}") from None
    if proc.returncode != 0:
        raise SlurmError(f"`scontrol {' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def fields(record: str) -> Dict[str, str]:
    """`Key=value Key2=value2 ...` lines of `scontrol show` -> dict (a value holding spaces keeps its first word)."""
    out = {}
    for token in record.split():
        key, sep, value = token.partition("=")
        if sep and key not in out:
            out[key] = value
    return out


def _count(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name, "")
        if value:
            try:
                return int(value.split("(")[0])
            except ValueError:
                raise SlurmError(f"{name}={value!r} is not a number") from None
    return None


def _check_nodes(env: Mapping[str, str], nodes: int) -> None:
    wanted = env.get("NNODES", "")
    if wanted and wanted != str(nodes):
        raise SlurmError(f"NNODES={wanted} but the SLURM allocation has {nodes} node(s); leave NNODES unset under "
                         f"SLURM (launch.sh takes the allocation's nodes) or ask for them: sbatch -N {wanted}")


def step_options(env: Mapping[str, str]) -> List[str]:
    """The batch script's srun command (launch.sh and its arguments follow): one task on every node."""
    nodes = _count(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    if nodes is None:
        raise SlurmError("SLURM_JOB_NUM_NODES is not set: not inside a SLURM allocation")
    _check_nodes(env, nodes)
    tasks = _count(env, "SLURM_NTASKS")
    if tasks is not None and tasks < nodes:
        raise SlurmError(f"the SLURM allocation has {tasks} task(s) on {nodes} nodes; launch.sh starts one task per "
                         f"node, each starting that node's ranks: allocate at least one task per node "
                         f"(sbatch -N {nodes} without --ntasks, or --ntasks-per-node=1)")
    # --kill-on-bad-exit: a node that fails ends the others at once instead of leaving them in a rendezvous.
    return ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            "--export=ALL"]


def node_settings(env: Mapping[str, str]) -> Dict[str, str]:
    """One srun task per node -> NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT for torchrun / deepspeed."""
    nodes = _count(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    tasks = _count(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if nodes is None or tasks is None or "SLURM_NODEID" not in env:
        raise SlurmError("not inside a SLURM job step (SLURM_STEP_NUM_NODES, SLURM_STEP_NUM_TASKS, SLURM_NODEID): "
                         "start launch.sh with sbatch or srun")
    _check_nodes(env, nodes)
    if tasks != nodes:
        raise SlurmError(f"this SLURM step runs {tasks} task(s) on {nodes} node(s); launch.sh must run once per node "
                         f"(it starts the node's ranks itself): srun --ntasks-per-node=1 launch.sh ... "
                         f"(or sbatch -N {nodes} launch.sh ...)")
    node_rank = _count(env, "SLURM_NODEID")
    if nodes == 1:  # one node: torchrun's standalone rendezvous on a free port
        return {"NNODES": "1", "NODE_RANK": "0"}
    first = scontrol("show", "hostnames", env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]).split()[0]
    address = env.get("MASTER_ADDR") or fields(scontrol("show", "node", first)).get("NodeAddr") or first
    port = env.get("MASTER_PORT") or str(PORT_BASE + int(env["SLURM_JOB_ID"]) % PORT_SPAN)
    return {"NNODES": str(nodes), "NODE_RANK": str(node_rank), "MASTER_ADDR": address, "MASTER_PORT": port}


def main(argv: List[str]) -> int:
    env = dict(os.environ)
    try:
        if argv == ["step"]:
            print(" ".join(step_options(env)))
        elif argv[:1] == ["node"]:
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in node_settings(env).items()))
        else:
            print("usage: python -m trainer.launch.slurm step | node", file=sys.stderr)
            return EXIT_BAD_INPUT
    except SlurmError as e:
        print(f"launch.sh: error: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
