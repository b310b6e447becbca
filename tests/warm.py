"""Warm starts for the test suite's launches (tests/warm_start/, docs/testing.md): servers that have imported torch
and transformers once per pytest process, from which the ranks of a warm launch are forked instead of importing them
again (about 3 s of CPU each). `warm_env(env, overrides)` returns the environment for a warm launch, or `env`
unchanged when warm starts are off (TESSERA_TEST_COLD=1), `env` sets variables the imports could read, or no server
could start.

A server serves the launches whose environment its imports would have seen the same (a test that changes
os.environ, or an import in the pytest process that does, gets a new one; at most MAX_SERVERS run at once) and of its
flavour: runs whose overrides choose a ZeRO strategy or LoRA/QLoRA import
DeepSpeed or peft anyway (1.7 s each), so their server has them imported too; no other run finds them imported.

What a warm rank shares with a fresh one: its launcher, argv, environment, directory, streams, exit code or signal,
the signals sent to it (its own process passes them on). What differs, so tests of these run cold: its parent is the
server (os.getppid, the launcher chain Tessera's guards walk), /proc/<pid>/cmdline and environ show the server's, a
SIGSTOP sent to the rank's own process does not stop the copy, and all warm processes share one hash seed."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.warm_start.zygote import differing, import_time_env

HERE = Path(__file__).resolve().parent / "warm_start"
MAX_SERVERS = 4  # per pytest process (each holds ~0.5 GB); a new one retires the one least recently used
_lock = threading.Lock()
_servers = []  # the running servers of this process: _Server
_folders = []  # every server's folder (its logs), retired ones too
_failed = []  # the flavours whose server did not start: their launches start cold from then on


class _Server:
    def __init__(self, env: dict, modules: tuple, path: str, proc, import_set: dict):
        self.env, self.modules, self.path, self.proc, self.import_set = env, modules, path, proc, import_set
        self.used = time.monotonic()

    def serves(self, env: dict, modules: tuple) -> bool:
        return modules == self.modules and not differing(env, self.env, self.import_set)


def base_env(env=None) -> dict:
    """The environment launches run with (tests/integration/conftest.launch)."""
    return dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def flavour(overrides) -> tuple:
    """The modules a run with these overrides imports beyond every run's: DeepSpeed (a ZeRO strategy), peft."""
    last = {}
    for item in overrides:
        key, sep, value = str(item).partition("=")
        if sep:
            last[key.lstrip("+~")] = value
    extra = ("deepspeed",) if last.get("strategy", "").startswith("zero") else ()
    return extra + (("peft",) if last.get("peft", "none") in ("lora", "qlora") else ())


def warm_env(env: dict, overrides=()) -> dict:
    if os.environ.get("TESSERA_TEST_COLD") == "1":
        return env
    if import_time_env(env) != import_time_env(base_env()):
        return env  # the test's own variables: the run starts cold
    path = _socket(env, flavour(overrides))
    if path is None:
        return env
    pythonpath = os.pathsep.join(p for p in [str(HERE), env.get("PYTHONPATH", "")] if p)
    return dict(env, PYTHONPATH=pythonpath, TESSERA_TEST_ZYGOTE=path)


def served() -> list:
    """{"argv", "pid"} of every rank this process's servers started warm (pid: the copy that ran it)."""
    return _log("served.log")


def declined() -> list:
    """{"argv", "why"} of every request this process's servers declined (those ranks started cold)."""
    return _log("declined.log")


def cpu_seconds(test: str) -> float:
    """CPU seconds of the warm copies that ran for `test` (a node id) and have ended."""
    return sum(r["cpu_s"] for r in _log("cpu.log") if r["test"] == test)


def _log(name: str) -> list:
    records = []
    for folder in list(_folders):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as fh:
                records += [json.loads(line) for line in fh if line.strip()]
    return records


def _socket(env: dict, modules: tuple):
    with _lock:
        if modules in _failed:
            return None
        server = next((s for s in _servers if s.serves(env, modules)), None)
        if server is None:
            if len(_servers) >= MAX_SERVERS:
                oldest = min(_servers, key=lambda s: s.used)
                _servers.remove(oldest)
                _retire(oldest)
            server = _start(env, modules)
            if server is None:
                _failed.append(modules)
                return None
            _servers.append(server)
        server.used = time.monotonic()
        return server.path


def _start(env: dict, modules: tuple):
    """A server started with `env` that has `modules` imported beyond every rank's, or None when it did not start."""
    folder = tempfile.mkdtemp(prefix="tessera-warm-")
    path = os.path.join(folder, "zygote.sock")
    server_env = dict(env, PYTHONPATH=os.pathsep.join(p for p in [str(HERE), env.get("PYTHONPATH", "")] if p))
    server_env.pop("TESSERA_TEST_ZYGOTE", None)
    proc = subprocess.Popen([sys.executable, str(HERE / "zygote.py"), path, *modules], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=server_env, cwd=folder)
    try:
        import_set = json.loads(proc.stdout.readline())["ready"]
    except (ValueError, KeyError, TypeError):
        proc.kill()
        print("warning: a warm-start server did not start; launches start cold", file=sys.stderr)
        return None
    _folders.append(folder)
    atexit.register(_stop, proc, folder)
    return _Server(env, modules, path, proc, import_set)


def _retire(server) -> None:
    """No more requests; the server ends once the runs it started have ended."""
    try:
        server.proc.stdin.write(b"retire\n")
        server.proc.stdin.flush()
    except OSError:
        pass


def _stop(proc, folder: str) -> None:
    try:
        proc.stdin.close()  # the server ends when its stdin closes, and kills what it still runs
    except OSError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(folder, ignore_errors=True)
