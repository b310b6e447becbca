"""Put this folder on PYTHONPATH with TESSERA_TEST_ZYGOTE=<socket> set (tests/warm.py does both), and a process
that starts trainer/main.py (or the architecture matrix's worker), or a launcher that imports torch before it starts
them (torchrun, launch.sh's `python -m trainer.torchrun`, DeepSpeed's runner), hands itself over to the warm-start
server at that socket (zygote.py here) instead of importing torch and transformers itself: the server forks a copy
that has them imported already and runs the script with this process's argv, environment, directory and standard
streams. This process stays what its launcher started: it passes the signals it receives on to the copy and ends as
the copy ended (its exit code, or killed by the same signal); when it is killed itself the server kills the copy.
When the server declines (an environment it was not started with) or is gone, the script starts here as usual.
Every other process is untouched."""
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The scripts whose processes are ranks: the entry point, and the architecture matrix's worker (the same build and
# training loop, several architectures per launch).
_SCRIPTS = (os.path.join(_REPO, "trainer", "main.py"), os.path.join(_REPO, "tests", "integration", "arch_worker.py"))
# Launchers: 2 to 7 s of CPU to import torch (and DeepSpeed) before the first rank starts, on every launch. Not
# DeepSpeed's launch.py, whose ranks Tessera's deepspeed wrapper finds as its process's children.
_LAUNCHER_SCRIPTS = tuple(os.path.join(os.path.dirname(sys.executable), name) for name in ("torchrun", "deepspeed"))
_LAUNCHER_MODULES = ("trainer.torchrun",)
_FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT", "SIGALRM")


def _target():
    """{"module": name} for `python -m <launcher module>`, {} for one of the scripts, None for any other process."""
    if sys.argv and sys.argv[0] == "-m":  # the module's name is still only on the original command line
        args = list(getattr(sys, "orig_argv", []))
        module = args[args.index("-m") + 1] if "-m" in args[:-1] else ""
        return {"module": module} if module in _LAUNCHER_MODULES else None
    if sys.argv and sys.argv[0] and os.path.abspath(sys.argv[0]) in _SCRIPTS + _LAUNCHER_SCRIPTS:
        return {}
    return None


def _hand_over(path: str, target: dict) -> None:
    import array
    import json
    import signal
    import socket

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        return  # no server: start cold
    umask = os.umask(0)
    os.umask(umask)
    request = {"argv": sys.argv, "orig_argv": getattr(sys, "orig_argv", sys.argv), "cwd": os.getcwd(),
               "env": dict(os.environ), "path": sys.path, "umask": umask, "executable": sys.executable,
               "flags": list(sys.flags), **target}
    conn.sendmsg([json.dumps(request).encode() + b"\n"],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]).tobytes())])
    reader = conn.makefile("rb")
    reply = json.loads(reader.readline() or b'{"cold": "the server closed"}')
    if "pid" not in reply:
        conn.close()
        return
    child = reply["pid"]
    for name in _FORWARDED:
        signal.signal(getattr(signal, name), lambda sig, _frame: _forward(child, sig))
    _parent_death_signal(signal.SIGTERM)  # as the trainer's own guard asks for: its launcher's end ends the copy
    end = json.loads(reader.readline() or b'{"exit": 1}')  # the server ends before the copy: an error
    _end_as(end)


def _parent_death_signal(sig: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _forward(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _end_as(end: dict) -> None:
    import signal

    if "signal" in end:
        signal.signal(end["signal"], signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [end["signal"]])
        os.kill(os.getpid(), end["signal"])
    os._exit(end.get("exit", 1))


if os.environ.get("TESSERA_TEST_ZYGOTE"):
    _TARGET = _target()
    if _TARGET is not None:
        _hand_over(os.environ["TESSERA_TEST_ZYGOTE"], _TARGET)
