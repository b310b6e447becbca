"""Launchers. For launch.sh: compose the config from the command-line overrides and print which launcher the chosen
strategy needs (python, torchrun, deepspeed, or torchft: replica groups with their lighthouse); prints `python` when the
overrides don't compose, so the entry point itself reports the problem once. For tests and benchmarks: the command line
of each launcher (`launcher_command`) and a run whose whole process group dies on a timeout (`run_process_group`)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from trainer.config.compose import REPO, compose

MAIN = str(REPO / "trainer" / "main.py")


# strategy.name -> the launcher it needs: each strategy class declares it (Capabilities.launcher); this copy lets
# launch.sh choose without importing torch (tests/unit/launch/test_choose.py holds the two equal).
LAUNCHERS = {"single": "python", "ddp": "torchrun", "zero1": "deepspeed", "zero2": "deepspeed", "zero3": "deepspeed",
             "zero3_offload": "deepspeed", "fsdp": "torchrun", "hsdp": "torchrun", "tp": "torchrun", "pp": "torchrun",
             "fsdp_tp": "torchrun", "pp_fsdp": "torchrun", "3d": "torchrun"}


def _launcher(cfg) -> str:
    if cfg.strategy.name not in LAUNCHERS:
        return "python"  # an unknown strategy: the entry point reports it
    if cfg.strategy.fault_tolerance == "torchft" and cfg.strategy.replica_group == -1:
        return "torchft"  # a lighthouse and every replica group on this machine (trainer/launch/torchft.py)
    return LAUNCHERS[cfg.strategy.name]


def launcher_for(overrides) -> str:
    return _launcher(compose(overrides))


def plan_for(overrides) -> str:
    """launch.sh's line: the launcher and train.max_restarts (`torchrun 3`); `python 0` when the overrides do not
    compose (the entry point reports the problem itself)."""
    try:
        cfg = compose(overrides)
        launcher, restarts = _launcher(cfg), int(cfg.train.max_restarts)
    except Exception:  # noqa: BLE001 - any composition problem is reported by the real run
        return "python 0"
    return f"{launcher} {max(restarts, 0)}"


def launcher_command(launcher: str, nproc: int = 1, script: str = MAIN) -> list:
    """The command that starts `script` (default trainer/main.py) on `nproc` local processes with `launcher`:
    `python`, `torchrun`, `torchrun-quiet` (launch.sh's torchrun: signals forwarded, one-line failures) or
    `deepspeed`, from the running interpreter's environment, on a free port."""
    from trainer.parallel.dims import free_port  # torch: only where a launch command is made

    bin_dir = os.path.dirname(sys.executable)
    if launcher == "python":
        return [sys.executable, script]
    if launcher == "torchrun":
        return [os.path.join(bin_dir, "torchrun"), f"--nproc_per_node={nproc}", f"--master_port={free_port()}", script]
    if launcher == "torchrun-quiet":
        return [sys.executable, "-m", "trainer.torchrun", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
                script]
    if launcher == "deepspeed":
        return [os.path.join(bin_dir, "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), script]
    raise ValueError(f"unknown launcher {launcher!r} (python, torchrun, torchrun-quiet, deepspeed)")


def run_process_group(cmd, env=None, timeout: float = 300, cwd: str = REPO) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own: on a timeout every process the launcher started is killed too, and
    AssertionError reports the timeout with the output's tail (a hang fails instead of leaving orphans).
    The result carries `seconds`, the wall time."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s (a hang?)\nSTDOUT:\n{out[-3000:]}\nSTDERR:\n{err[-3000:]}")
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    done.seconds = time.perf_counter() - t0
    return done


if __name__ == "__main__":
    print(plan_for(sys.argv[1:]))
