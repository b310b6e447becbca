"""Stopping a run with a signal, through every launcher: SIGTERM (or Ctrl-C) to the launcher or to one rank stops
every rank after the same step with a complete checkpoint, the launcher exits 0 with one stop line and no
traceback, and no rank outlives its launcher, not even a SIGKILLed one. Each case is a row of the catalogue."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.catalogue import Timer, check_case
from tests.integration.conftest import REPO, SMALL, VENV_BIN, free_port

LONG = SMALL + ["train.max_steps=100000", "train.log_every=1", "checkpoint.every=0", "eval.every=0",
                "eval.at_end=false", "export.hf_at_end=false", "train.global_batch_size=8",
                "train.micro_batch_size=2"]
STOP_LINE = re.compile(r"stopped by (SIG\w+) at step (\d+)")
MAIN = str(REPO / "trainer" / "main.py")


def _command(launcher: str, strategy: str, run_dir: Path) -> list:
    args = LONG + [f"strategy={strategy}", f"hydra.run.dir={run_dir}"]
    if launcher == "python":
        return [sys.executable, MAIN] + args
    if launcher == "torchrun":
        return [str(VENV_BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", MAIN] + args
    if launcher == "deepspeed":
        return [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), MAIN] + args
    if launcher == "launch.sh":
        return [str(REPO / "launch.sh")] + args
    raise ValueError(launcher)


def _env() -> dict:
    venv = os.path.dirname(os.path.dirname(sys.executable))
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NPROC_PER_NODE="2", TESSERA_VENV=venv,
                MASTER_PORT=str(free_port()))


def _processes_of(run_dir: Path) -> list:
    """Live processes (not zombies) whose command line names this run's directory: launchers and ranks."""
    needle = str(run_dir).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read()
            with open(f"/proc/{entry}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state not in ("Z", "X"):
            found.append((int(entry), cmd.replace(b"\0", b" ").decode(errors="replace")[:160]))
    return found


def _rank_pids(run_dir: Path) -> list:
    return [pid for pid, cmd in _processes_of(run_dir) if "trainer/main.py" in cmd and "-m trainer." not in cmd
            and "deepspeed.launcher" not in cmd and "/torchrun" not in cmd and "launch.sh" not in cmd
            and "bin/deepspeed" not in cmd]


def _logged_steps(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


class Launch:
    """A run started in its own session, its output in files (a pipe nobody reads could block it)."""

    def __init__(self, tmp_path: Path, launcher: str, strategy: str):
        self.run_dir = tmp_path / "run"
        self.out, self.err = open(tmp_path / "stdout", "w+"), open(tmp_path / "stderr", "w+")
        self.proc = subprocess.Popen(_command(launcher, strategy, self.run_dir), cwd=REPO, env=_env(),
                                     stdout=self.out, stderr=self.err, start_new_session=True)

    def wait_for_steps(self, n: int = 3, timeout: float = 600) -> None:  # a first ZeRO run may build an op
        deadline = time.time() + timeout
        while _logged_steps(self.run_dir) < n:
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                raise AssertionError(f"no {n} logged steps (exit {self.proc.returncode})\n{self.output()[-4000:]}")
            time.sleep(0.2)

    def wait(self, timeout: float = 120):
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"no exit {timeout} s after the signal\n{self.output()[-4000:]}")
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self._read(self.out),
                                           self._read(self.err))

    def output(self) -> str:
        return self._read(self.out) + self._read(self.err)

    @staticmethod
    def _read(fh) -> str:
        fh.flush()
        fh.seek(0)
        return fh.read()

    def kill(self) -> None:
        from trainer.launch.torchrun import children

        pids = [pid for pid, _ in _processes_of(self.run_dir)]
        for pid in pids:  # with their descendants (an op build's ninja and compilers)
            pids += [c for c in children(pid) if c not in pids]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _none_left(run_dir: Path, within: float = 10.0) -> float:
    """Seconds until no process of the run remains (fails after `within`)."""
    t0 = time.time()
    while _processes_of(run_dir):
        if time.time() - t0 > within:
            left = _processes_of(run_dir)
            for pid, _ in left:
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"processes outlived the launcher: {left}")
        time.sleep(0.2)
    return time.time() - t0


def _check_checkpoint(run_dir: Path, step: int) -> None:
    ckpt = run_dir / "checkpoints" / f"step_{step}"
    assert (ckpt / "COMPLETE.json").is_file(), sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert json.loads((ckpt / "COMPLETE.json").read_text())["step"] == step
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    assert not list((run_dir / "checkpoints").glob(".tmp-step_*"))
    assert _logged_steps(run_dir) == step  # every rank stopped after the same step: the last one logged


def _graceful(tmp_path, case, launcher, strategy, sig, target="launcher", code=0, traceback_ok=False):
    run = Launch(tmp_path, launcher, strategy)
    run.wait_for_steps()
    pid = run.proc.pid if target == "launcher" else _rank_pids(run.run_dir)[-1]
    with Timer() as t:
        os.kill(pid, sig)
        proc = run.wait()
    out = proc.stdout + proc.stderr
    stops = STOP_LINE.findall(out)
    assert len(stops) == 1, f"{case}: stop lines {stops}\n{out[-4000:]}"
    assert stops[0][0] == signal.Signals(sig).name or target != "launcher", stops
    check_case(case, proc, t.seconds, code, "stopped by", allow_traceback=traceback_ok)
    _check_checkpoint(run.run_dir, int(stops[0][1]))
    _none_left(run.run_dir)
    return proc, t.seconds


@pytest.mark.parametrize("launcher,strategy,sig", [
    ("python", "single", signal.SIGTERM),
    ("launch.sh", "ddp", signal.SIGTERM),
    ("launch.sh", "ddp", signal.SIGINT),
    ("launch.sh", "zero2", signal.SIGTERM),
], ids=["python-single-TERM", "launch.sh-ddp-TERM", "launch.sh-ddp-INT", "launch.sh-zero2-TERM"])
def test_a_signal_to_the_launcher_saves_and_exits_0(tmp_path, launcher, strategy, sig):
    ranks = "1 process" if launcher == "python" else "2 ranks"
    proc, _ = _graceful(tmp_path, f"{signal.Signals(sig).name} to {launcher} ({strategy}, {ranks})", launcher,
                        strategy, sig)
    if launcher == "launch.sh":  # launch.sh picked the strategy's launcher: deepspeed for ZeRO, torchrun otherwise
        out = proc.stdout + proc.stderr
        assert ("deepspeed.launcher.launch" in out) == strategy.startswith("zero"), out[-3000:]
        assert f"strategy {strategy} world 2" in out


def test_sigterm_to_one_rank_stops_all_and_the_launcher_exits_0(tmp_path):
    _graceful(tmp_path, "SIGTERM to one rank (launch.sh ddp)", "launch.sh", "ddp", signal.SIGTERM, target="rank")


def test_sigterm_to_the_torchrun_cli(tmp_path):
    """torchrun alone: its agent forwards SIGTERM and waits for the ranks (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s),
    which save; torchrun itself then raises SignalException (exit 1, its traceback): launch.sh's wrapper is the
    launcher that exits 0."""
    _graceful(tmp_path, "SIGTERM to the torchrun CLI (ddp): torchrun's own exit", "torchrun", "ddp",
              signal.SIGTERM, code=1, traceback_ok=True)


def test_sigterm_to_the_deepspeed_runner(tmp_path):
    """The `deepspeed` runner alone has no SIGTERM handler: it ends at once (killed by the signal). Its ranks see
    it gone, stop after the same step and save; its launch.py then exits 0: nothing is left."""
    run = Launch(tmp_path, "deepspeed", "ddp")
    run.wait_for_steps()
    with Timer() as t:
        os.kill(run.proc.pid, signal.SIGTERM)
        proc = run.wait()
        gone = _none_left(run.run_dir, within=60)
    out = run.output()  # the ranks outlived the runner by the time of their save
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, out[-3000:])
    stops = STOP_LINE.findall(out)
    assert len(stops) == 1, f"stop lines {stops}\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    _check_checkpoint(run.run_dir, int(stops[0][1]))
    from tests.integration import catalogue

    catalogue.record("SIGTERM to the bare deepspeed runner (ddp): runner killed, ranks saved", proc.returncode,
                     t.seconds, f"ranks gone {gone:.1f} s after the runner; " + stops[0][0] + " stop at step "
                     + stops[0][1])


def test_sigkill_of_torchrun_the_ranks_save_and_exit(tmp_path):
    """SIGKILL of torchrun (its workers run in sessions of their own): the ranks get SIGTERM from the kernel
    (parent-death signal), stop after the same step, save and exit within seconds."""
    run = Launch(tmp_path, "torchrun", "ddp")
    run.wait_for_steps()
    with Timer() as t:
        os.kill(run.proc.pid, signal.SIGKILL)
        proc = run.wait()
        gone = _none_left(run.run_dir, within=60)
    assert proc.returncode == -signal.SIGKILL
    out = run.output()  # the ranks' output went to the same files
    stops = STOP_LINE.findall(out)
    assert len(stops) == 1, f"stop lines {stops}\n{out[-4000:]}"
    _check_checkpoint(run.run_dir, int(stops[0][1]))
    assert t.seconds < 30, t.seconds
    from tests.integration import catalogue

    catalogue.record("SIGKILL of torchrun (ddp): ranks save and exit", proc.returncode, t.seconds,
                     f"ranks gone {gone:.1f} s after the kill; checkpoint at step {stops[0][1]}")
