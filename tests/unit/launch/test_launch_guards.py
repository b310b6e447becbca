"""DeepSpeed op build locks (trainer/launch/ds_ops.py) and the launcher guards of the ranks (trainer/resilience/preemption.py),
without a real build or launch."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from trainer.launch import ds_ops

from trainer.resilience import preemption
from tessera.errors import EXIT_BAD_INPUT

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / ds_ops.SHM_COMM
    folder.mkdir()
    return folder


def _age(path, seconds):
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_no_lock_is_fine(ext_dir):
    assert ds_ops.build_dir(ds_ops.SHM_COMM) == str(ext_dir)
    assert ds_ops.lock_state(ds_ops.SHM_COMM)[1] == "none"
    ds_ops.check_locks([ds_ops.SHM_COMM])


def test_an_old_lock_nobody_builds_under_is_stale(ext_dir):
    lock = ext_dir / "lock"
    lock.touch()
    _age(lock, 600)
    _age(ext_dir, 600)
    assert ds_ops.lock_state(ds_ops.SHM_COMM) == (str(lock), "stale")
    with pytest.raises(ds_ops.BuildLockError) as e:
        ds_ops.check_locks([ds_ops.SHM_COMM])
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert str(lock) in str(e.value) and f"rm {lock}" in str(e.value)


def test_a_fresh_lock_is_a_build_starting_until_the_grace_period_passes(ext_dir):
    lock = ext_dir / "lock"
    lock.touch()
    assert ds_ops.lock_state(ds_ops.SHM_COMM)[1] == "recent"
    assert ds_ops.lock_state(ds_ops.SHM_COMM, now=time.time() + 120, grace=60)[1] == "stale"
    with pytest.raises(ds_ops.BuildLockError):  # the wait gives up as soon as the lock is stale
        ds_ops.wait_for_locks([ds_ops.SHM_COMM], say=print, grace=0.5, poll=0.1)


def test_a_lock_released_while_it_is_judged_is_not_stale(ext_dir, monkeypatch):
    """Every loading process holds the lock for a moment; one released between the checks (the folder's other
    files long unchanged) once read as stale and killed a healthy run (CI, three ZeRO launches at once)."""
    for old in ("build.ninja", "shm.o"):
        (ext_dir / old).touch()
        _age(ext_dir / old, 600)
    lock = ext_dir / "lock"
    lock.touch()

    def released_meanwhile(folder):
        lock.unlink()
        return []

    monkeypatch.setattr(ds_ops, "builders", released_meanwhile)
    assert ds_ops.lock_state(ds_ops.SHM_COMM)[1] != "stale"
    lock.touch()
    _age(lock, 600)
    assert ds_ops.lock_state(ds_ops.SHM_COMM)[1] == "none"  # old lock, but gone by the time it is judged


def test_a_lock_with_a_process_working_in_the_folder_is_live(ext_dir):
    lock = ext_dir / "lock"
    lock.touch()
    _age(lock, 600)
    _age(ext_dir, 600)
    builder = subprocess.Popen(["sleep", "30"], cwd=ext_dir)  # ninja and the compilers run in the build folder
    try:
        assert ds_ops.lock_state(ds_ops.SHM_COMM)[1] == "live"
        assert builder.pid in ds_ops.builders(str(ext_dir))
    finally:
        builder.kill()
        builder.wait()
    assert ds_ops.lock_state(ds_ops.SHM_COMM)[1] == "stale"


def test_a_removed_lock_ends_the_wait(ext_dir):
    lock = ext_dir / "lock"
    lock.touch()
    remover = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(0.5); os.remove({str(lock)!r})"])
    try:
        ds_ops.wait_for_locks([ds_ops.SHM_COMM], say=print, grace=60, poll=0.1)
    finally:
        remover.wait()
    assert not lock.exists()


def test_the_check_command_exits_2_naming_the_lock(ext_dir):
    lock = ext_dir / "lock"
    lock.touch()
    _age(lock, 600)
    _age(ext_dir, 600)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "trainer.ds_ops", "check"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"rm {lock}" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_needed_ops():
    assert ds_ops.needed_ops(cuda=True) == []
    assert ds_ops.needed_ops(cuda=True, offload_nvme=True) == [ds_ops.AIO]
    if sys.platform.startswith("linux"):
        assert ds_ops.needed_ops(cuda=False) == [ds_ops.SHM_COMM]


@pytest.mark.parametrize("args,expected", [
    (["/venv/bin/python", "/venv/bin/deepspeed", "--num_gpus", "2", "trainer/main.py"], True),
    (["/venv/bin/python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=x"], True),
    (["/venv/bin/python", "/venv/bin/torchrun", "--nproc_per_node=2"], True),
    (["torchrun", "--standalone"], True),
    (["/venv/bin/python", "-m", "trainer.torchrun", "--standalone"], True),
    (["/venv/bin/python", "-m", "trainer.launch.deepspeed", "--num_gpus", "2"], True),
    (["/venv/bin/python", "-m", "pytest", "-k", "torchrun"], False),
    (["bash"], False),
    (["/venv/bin/python", "trainer/main.py", "strategy=ddp"], False),
])
def test_launchers_are_recognised_by_their_command_line(args, expected):
    assert preemption.is_launcher(args) is expected


def test_the_launcher_chain_finds_tessera_launcher_pid(monkeypatch):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        monkeypatch.setenv("TESSERA_LAUNCHER_PID", str(sleeper.pid))
        chain = preemption.launcher_chain()
        assert sleeper.pid in [pid for pid, _ in chain]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert preemption.proc_stat(sleeper.pid) is None


GUARDED = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
from trainer.resilience import preemption  # a rank (TESSERA_LAUNCHER_PID is set): the import arms the guard
assert preemption.guard_started()
print("armed", flush=True)
deadline = time.time() + 20
while not got and time.time() < deadline:
    time.sleep(0.05)
print("stopped" if got else "not stopped", flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG are Linux's")
def test_a_rank_gets_sigterm_when_its_launcher_dies(tmp_path):
    """A watched launcher (here: TESSERA_LAUNCHER_PID, a process that is not the rank's parent) is SIGKILLed:
    the guard thread sends the rank SIGTERM, which its StopRequest turns into a stop after the step."""
    launcher = subprocess.Popen(["sleep", "60"])
    env = dict(os.environ, TESSERA_LAUNCHER_PID=str(launcher.pid))
    env.pop("LOCAL_RANK", None)
    rank = subprocess.Popen([sys.executable, "-c", GUARDED.format(repo=REPO)], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert rank.stdout.readline().strip() == "armed"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        assert rank.stdout.readline().strip() == "stopped"
        assert rank.wait(timeout=20) == 0
    finally:
        for p in (launcher, rank):
            if p.poll() is None:
                p.kill()


def test_each_virtual_environment_builds_its_ops_in_its_own_folder(monkeypatch, tmp_path):
    """Two venvs sharing torch's default folder rebuilt each other's DeepSpeed op at every ZeRO run (minutes):
    in a venv the ops live under <venv>/torch_extensions/<tag>; a TORCH_EXTENSIONS_DIR the user set wins."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # restored after the test (the environment's ninja)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    (tmp_path / "venv").mkdir()
    ds_ops.use_environment_root()
    root = os.environ["TORCH_EXTENSIONS_DIR"]
    assert root.startswith(str(tmp_path / "venv" / "torch_extensions") + os.sep), root
    assert ds_ops.build_dir(ds_ops.SHM_COMM) == os.path.join(root, ds_ops.SHM_COMM)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    ds_ops.use_environment_root()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(sys, "base_prefix", sys.prefix)  # not a venv: torch's own default
    ds_ops.use_environment_root()
    assert "TORCH_EXTENSIONS_DIR" not in os.environ


def test_ops_are_built_by_the_environments_own_ninja(monkeypatch, tmp_path):
    """pip's ninja (DeepSpeed's dependency, in the venv) and a system ninja hash build commands differently: an op
    one built, the other rebuilt (34 s per ZeRO launch). Whatever PATH the run was started with, the environment's
    ninja is found first; without one in the environment, PATH is left alone."""
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    system_bin = tmp_path / "usr" / "bin"
    system_bin.mkdir(parents=True)
    for folder in (venv_bin, system_bin):
        (folder / "ninja").write_text("#!/bin/sh\n")
        (folder / "ninja").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", os.pathsep.join([str(system_bin), str(venv_bin), "/bin"]))
    ds_ops.use_environment_ninja()
    assert shutil.which("ninja") == str(venv_bin / "ninja")
    assert os.environ["PATH"].split(os.pathsep) == [str(venv_bin), str(system_bin), "/bin"]
    ds_ops.use_environment_ninja()  # once is enough: nothing added twice
    assert os.environ["PATH"].split(os.pathsep) == [str(venv_bin), str(system_bin), "/bin"]
    (venv_bin / "ninja").unlink()
    monkeypatch.setenv("PATH", os.pathsep.join([str(system_bin), "/bin"]))
    ds_ops.use_environment_ninja()
    assert os.environ["PATH"] == os.pathsep.join([str(system_bin), "/bin"])
