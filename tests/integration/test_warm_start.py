"""The suite's warm starts (tests/warm.py, tests/warm_start/): a rank forked from the warm-start server runs the
same training as a cold one (the same numbers, output and exit code), ends as its own process is ended (SIGTERM
reaches the trainer, SIGKILL kills the copy), and an environment the server was not started with starts cold."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import warm
from tests.integration.conftest import REPO, SMALL, launch, launcher_command, metrics, ok, run_process_group

STEPS = SMALL + ["train.max_steps=3", "train.log_every=1", "eval.every=0", "checkpoint.at_end=false"]


def _served(run_dir, ranks: bool = True) -> list:
    """The ranks (or, ranks=False, the launcher) of the launch into `run_dir` that ran warm."""
    return [r for r in warm.served()
            if f"hydra.run.dir={run_dir}" in r["argv"] and r["argv"][0].endswith("main.py") == ranks]


def _launchers_served(run_dir) -> list:
    return _served(run_dir, ranks=False)


@pytest.mark.parametrize("launcher,strategy,nproc", [("python", "single", 1), ("torchrun", "ddp", 2),
                                                     ("torchrun-quiet", "fsdp", 2)])
def test_a_warm_run_logs_the_numbers_of_a_cold_run(tmp_path, launcher, strategy, nproc):
    """The ranks and the launcher (torchrun, launch.sh's torchrun; a python launch has none) run warm."""
    runs = {}
    for mode in ("cold", "warm"):
        run_dir = tmp_path / mode
        proc = launch(launcher, STEPS + [f"strategy={strategy}"], run_dir, nproc=nproc, warm=mode == "warm")
        ok(proc)
        runs[mode] = metrics(run_dir)
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert len(_served(run_dir)) == (nproc if mode == "warm" else 0), warm.served()
        assert len(_launchers_served(run_dir)) == (launcher != "python" and mode == "warm"), warm.served()
    keys = ("step", "loss", "grad_norm", "lr", "tokens")
    assert [[r.get(k) for k in keys] for r in runs["warm"]] == [[r.get(k) for k in keys] for r in runs["cold"]]


def test_a_failing_run_exits_with_its_code_and_message(tmp_path):
    """A configuration error (heads that do not divide the width): the same exit code and message, warm as cold."""
    results = {}
    for mode in ("cold", "warm"):
        proc = launch("python", SMALL + ["strategy=single", "model.num_heads=3", "model.num_kv_heads=3"],
                      tmp_path / mode, warm=mode == "warm")
        results[mode] = (proc.returncode, proc.stdout, proc.stderr.replace(str(tmp_path / mode), "RUN"))
    assert results["warm"] == results["cold"], results
    assert results["warm"][0] == 2 and "must be divisible by model.num_heads=3" in results["warm"][2], results


def _start_long(run_dir, launcher: str = "python", nproc: int = 1) -> subprocess.Popen:
    env = warm.warm_env(warm.base_env())
    cmd = launcher_command(launcher, nproc) + SMALL + ["train.max_steps=100000", "train.log_every=1", "eval.every=0",
                                                       "checkpoint.every=0", "export.hf_at_end=false",
                                                       f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for_steps(proc, run_dir, steps: int = 2) -> None:
    deadline = time.time() + 120
    while not ((run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= steps):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)


def _gone(pid: int, within: float = 30) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _sigterm_saves(run_dir, launcher: str = "python", nproc: int = 1) -> None:
    """SIGTERM to the launch's own process after 2 steps: passed on to the copies, which save; exit 0."""
    stopped = _start_long(run_dir, launcher, nproc)
    try:
        _wait_for_steps(stopped, run_dir)
        os.kill(stopped.pid, signal.SIGTERM)
        out, err = stopped.communicate(timeout=120)
    finally:
        stopped.kill()
    assert stopped.returncode == 0, err[-3000:]
    assert "stopped by SIGTERM at step" in out + err, (out + err)[-3000:]
    assert (run_dir / "checkpoints" / "latest").exists()


def _copies_after_sigkill(run_dir, launcher: str = "python", nproc: int = 1) -> list:
    """SIGKILL to the launch's processes after 2 steps; the pids of the copies that served it (launcher first)."""
    killed = _start_long(run_dir, launcher, nproc)
    try:
        _wait_for_steps(killed, run_dir)
        copies = [r["pid"] for r in _launchers_served(run_dir) + _served(run_dir)]
        os.killpg(killed.pid, signal.SIGKILL)
        killed.communicate(timeout=60)
    finally:
        killed.kill()
    assert killed.returncode == -signal.SIGKILL
    return copies


def test_sigterm_reaches_the_trainer_and_sigkill_kills_the_copy(tmp_path):
    _sigterm_saves(tmp_path / "term")
    copy, = _copies_after_sigkill(tmp_path / "kill")
    assert _gone(copy), f"the copy {copy} outlived its rank's process"


def test_an_environment_the_server_did_not_see_starts_cold(tmp_path):
    """A variable the imports could read, set by the test itself: launch() starts cold; one the server was not
    started with in a request that reaches it (the pytest process's environment changed since): declined."""
    proc = launch("python", STEPS + ["strategy=single"], tmp_path / "own", env={"HF_HUB_DISABLE_TELEMETRY": "7"})
    ok(proc)
    assert not _served(tmp_path / "own") and not [r for r in warm.declined() if str(tmp_path / "own") in str(r)]

    env = dict(warm.warm_env(warm.base_env()), HF_HUB_DISABLE_TELEMETRY="7")
    cmd = launcher_command("python") + STEPS + ["strategy=single", f"hydra.run.dir={tmp_path / 'drifted'}"]
    ok(run_process_group(cmd, env=env))
    assert not _served(tmp_path / "drifted")
    assert any("HF_HUB_DISABLE_TELEMETRY" in r["why"] and f"hydra.run.dir={tmp_path / 'drifted'}" in r["argv"]
               for r in warm.declined()), warm.declined()
    assert (tmp_path / "drifted" / "metrics.jsonl").exists()


def test_the_flavour_follows_the_last_strategy_and_peft_overrides():
    """Which server a launch goes to (tests/warm.py: flavour): ZeRO runs DeepSpeed's, LoRA/QLoRA runs peft's."""
    assert warm.flavour(["strategy=zero2"]) == ("deepspeed",)
    assert warm.flavour(["strategy=zero3", "peft=lora"]) == ("deepspeed", "peft")
    assert warm.flavour(["strategy=zero2", "strategy=ddp", "peft=none"]) == ()
    assert warm.flavour(["strategy=fsdp", "+peft=qlora"]) == ("peft",)


def test_a_changed_environment_gets_a_server_of_its_own_and_the_oldest_retires(tmp_path, monkeypatch):
    """The pytest process's own environment changes (a test sets a variable, an import does): its launches are
    served warm by a new server; past MAX_SERVERS the least recently used one retires: it takes no more requests
    and ends once its runs have."""
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    ok(launch("python", STEPS + ["strategy=single"], tmp_path / "first"))
    assert [s for s in warm._servers if s.env.get("HF_HUB_DISABLE_TELEMETRY") == "1"]
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "2")
    monkeypatch.setattr(warm, "MAX_SERVERS", len(warm._servers))
    oldest = min(warm._servers, key=lambda s: s.used)
    ok(launch("python", STEPS + ["strategy=single"], tmp_path / "second"))
    assert len(_served(tmp_path / "first")) == 1 and len(_served(tmp_path / "second")) == 1
    assert oldest not in warm._servers and len(warm._servers) == warm.MAX_SERVERS
    oldest.proc.wait(timeout=30)  # retired: it ended by itself
    assert not os.path.exists(oldest.path)


def test_a_warm_launcher_passes_sigterm_on_and_sigkill_ends_every_copy(tmp_path):
    """launch.sh's torchrun served warm: SIGTERM to its own process reaches the ranks (they save and the launch
    exits 0, as cold: test_signals.py); SIGKILL to it ends the launcher's copy and both ranks' copies (a test's
    timeout kills a launch so)."""
    _sigterm_saves(tmp_path / "term", "torchrun-quiet", 2)
    assert len(_launchers_served(tmp_path / "term")) == 1 and len(_served(tmp_path / "term")) == 2
    copies = _copies_after_sigkill(tmp_path / "kill", "torchrun-quiet", 2)
    assert len(copies) == 3
    assert all(_gone(pid) for pid in copies), f"copies {copies} outlived the launch"


def test_a_copy_ends_as_the_interpreter_would(tmp_path):
    """zygote.run_and_exit: sys.exit("message") prints it and exits 1; a non-daemon thread is joined and the atexit
    functions run (what they write is there) before the copy ends without the teardown."""
    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, sys, threading, time\n"
        f"out = open({str(tmp_path / 'out.txt')!r}, 'w')\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), out.write('thread;'))).start()\n"
        "atexit.register(lambda: (out.write('atexit'), out.close()))\n"
        "sys.exit('the message')\n")
    runner = (f"import sys; sys.path.insert(0, {str(REPO / 'tests' / 'warm_start')!r}); import zygote; "
              f"sys.argv = [{str(script)!r}]; zygote.run_and_exit(None)")
    proc = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip() == "the message", proc.stderr
    assert (tmp_path / "out.txt").read_text() == "thread;atexit"
