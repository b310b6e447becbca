"""A rank that stops answering (SIGSTOP: a frozen node, a stalled file system, a debugger) in any phase ends the
job within a bounded time, with one message naming the phase and the silent rank, and leaves nothing running:
during a checkpoint save, during an evaluation and in the middle of a step, under launch.sh, torchrun and the
deepspeed launcher; and when the launcher itself is killed while a rank is frozen, the surviving rank ends and
kills the orphaned frozen one."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, SMALL, run_process_group
from trainer.launch.choose import launcher_command

HOOK = REPO / "tests" / "integration" / "freeze_hook"  # sitecustomize: rank RANK stops itself in PHASE
TIMEOUT_S = 6
BASE = SMALL + ["train.max_steps=8", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=4",
                "checkpoint.every=4", "eval.every=4", "eval.max_sequences=16", "export.hf_at_end=false",
                f"train.collective_timeout_s={TIMEOUT_S}", "train.max_restarts=0"]
# (launcher, strategy, the launch's exit code: Tessera's launchers end with the rank's 4, the raw ones with their own)
LAUNCHERS = {"launch.sh": ("fsdp", 4), "torchrun": ("ddp", None), "deepspeed": ("zero2", None)}
# phase -> (step it freezes in, what rank 0's message says of the phase)
PHASES = {"save": (4, "checkpoint save"), "eval": (4, "evaluation"), "step": (3, "step 3")}
BOUND_S = 240  # start-up (deepspeed's is slowest: a minute on a loaded machine) + 1.5 x the timeout + the launcher's
# shutdown (DeepSpeed's launch.py gives a stopped rank 30 s after SIGTERM before it SIGKILLs it)


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NPROC_PER_NODE="2",
               TESSERA_VENV=str(Path(sys.executable).parents[1]), TORCH_ELASTIC_SHUTDOWN_TIMEOUT="10")
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK), str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def _command(launcher: str, run_dir: Path) -> list:
    strategy, _ = LAUNCHERS[launcher]
    overrides = BASE + [f"strategy={strategy}", f"hydra.run.dir={run_dir}"]
    if launcher == "launch.sh":
        return ["bash", str(REPO / "launch.sh")] + overrides
    return launcher_command(launcher, 2) + overrides


def left_running(run_dir: Path, wait_s: float = 15.0) -> list:
    """Processes whose command line names the run directory (every rank's does), after up to `wait_s`."""
    deadline = time.time() + wait_s
    while True:
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmd = fh.read()
                with open(f"/proc/{entry}/stat") as fh:
                    state = fh.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if str(run_dir).encode() in cmd and state not in ("Z", "X"):
                found.append((int(entry), state))
        if not found or time.time() > deadline:
            return found
        time.sleep(0.5)


def _frozen_run(case, root: Path):
    launcher, phase = case
    run_dir = root / f"{launcher}-{phase}"
    step, _ = PHASES[phase]
    env = _env(TESSERA_TEST_FREEZE=f"{phase}:{step}:1")
    try:
        proc = run_process_group(_command(launcher, run_dir), env=env, timeout=BOUND_S + 60)
    except AssertionError as e:  # a hang: the output's tail says where
        return case, None, str(e), left_running(run_dir, 0)
    return case, proc, None, left_running(run_dir)


# Every phase and every launcher at least once (what the rank's message names comes from the watchdog, the same under
# every launcher; how the job ends and what is left running comes from the launcher): launch.sh in a save and mid-step,
# torchrun in an evaluation, the deepspeed launcher mid-step (its engine's collectives).
CASES = [("launch.sh", "save"), ("launch.sh", "step"), ("torchrun", "eval"), ("deepspeed", "step")]


@pytest.fixture(scope="module")
def frozen_runs(tmp_path_factory):
    """Every (launcher, phase) case, all at once (most of each is waiting on the timeout)."""
    root = tmp_path_factory.mktemp("frozen")
    with ThreadPoolExecutor(len(CASES)) as pool:
        return {case: rest for case, *rest in pool.map(lambda c: _frozen_run(c, root), CASES)}


@pytest.mark.parametrize("launcher,phase", CASES)
def test_a_frozen_rank_ends_the_job_with_one_message(frozen_runs, launcher, phase):
    proc, hang, leftovers = frozen_runs[(launcher, phase)]
    assert hang is None, hang
    out = proc.stdout + proc.stderr
    _, code = LAUNCHERS[launcher]
    assert proc.returncode != 0 and (code is None or proc.returncode == code), (proc.returncode, out[-4000:])
    assert proc.seconds < BOUND_S, (proc.seconds, out[-3000:])
    assert not leftovers, f"left running: {leftovers}\n{out[-3000:]}"
    errors = [line for line in out.splitlines() if line.startswith("[rank 0] error: ")]
    assert len(errors) == 1, out[-4000:]
    if launcher == "launch.sh":  # its torchrun SIGKILLs the frozen rank once rank 0 ended: no second rank's error
        assert len([line for line in out.splitlines() if "error: " in line]) == 1, out[-4000:]
    message = errors[0]
    _, where = PHASES[phase]
    assert "rank 1 (pid " in message and where in message, message
    assert "train.collective_timeout_s" in message, message
    # no rank's traceback: raw torchrun reports a failed rank with a traceback of its own (ChildFailedError)
    assert out.count("Traceback") == out.count("ChildFailedError:"), out[-4000:]
    print(f"{launcher} / frozen in {phase}: exit {proc.returncode} after {proc.seconds:.0f} s: {message[:300]}")


def _start_until_frozen(cmd, env, run_dir: Path) -> subprocess.Popen:
    """Start `cmd` (its own session) and return once one of its ranks is stopped (SIGSTOP: state T)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 120
    while not any(state == "T" for _, state in left_running(run_dir, 0)):
        if proc.poll() is not None or time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"no rank froze\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.1)
    return proc


def test_killed_launcher_with_a_frozen_rank_leaves_nothing_running(tmp_path):
    """launch.sh is SIGKILLed while rank 1 is frozen in a save: rank 0 ends within the collective timeout (not the
    launcher-gone grace of 600 s), names rank 1 and kills it (no one else would: its launcher is gone)."""
    run_dir = tmp_path / "run"
    env = _env(TESSERA_TEST_FREEZE="save:4:1")
    proc = _start_until_frozen(_command("launch.sh", run_dir), env, run_dir)
    try:
        t_kill = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)  # launch.sh exec'd the launcher: this is the launcher
        _, err = proc.communicate(timeout=BOUND_S)  # the pipes close once every rank has ended
        seconds = time.monotonic() - t_kill
    finally:
        for pid, _ in left_running(run_dir, 0):
            os.kill(pid, signal.SIGKILL)
    assert not left_running(run_dir), err[-3000:]
    message = next((line for line in err.splitlines() if line.startswith("[rank 0] error: ")), "")
    assert "rank 1 (pid " in message and "checkpoint save" in message, err[-3000:]
    assert "killed the orphaned rank(s) [1]" in message, message
    assert seconds < 1.5 * TIMEOUT_S + 30, seconds
    print(f"launcher killed: everything ended {seconds:.0f} s later: {message[:300]}")


def test_a_stop_that_a_frozen_rank_cannot_obey_ends_in_sigkill_after_the_grace(tmp_path):
    """SIGTERM to launch.sh while rank 1 is frozen mid-step and the collective timeout is long: the ranks cannot
    stop after the step, so the launcher SIGKILLs them once TESSERA_STOP_GRACE_S has passed (a stopped process
    runs no signal handler) and exits 4, with nothing left running."""
    run_dir = tmp_path / "run"
    env = _env(TESSERA_TEST_FREEZE="step:3:1", TESSERA_STOP_GRACE_S="5")
    cmd = _command("launch.sh", run_dir) + ["train.collective_timeout_s=300"]
    proc = _start_until_frozen(cmd, env, run_dir)
    try:
        t_stop = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - t_stop
    finally:
        for pid, _ in left_running(run_dir, 0):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 4, err[-3000:]
    assert "launch.sh: the ranks did not stop within 5 s of SIGTERM; killing them" in err, err[-3000:]
    assert not left_running(run_dir) and seconds < 30, (seconds, err[-3000:])
    print(f"stop grace: SIGTERM, then SIGKILL after the 5 s grace; everything ended {seconds:.0f} s later")
