"""The warm-start server of the test suite: one Python process that has imported what every rank of trainer/main.py
imports from torch and transformers (about 3 s of CPU per process, most of a small test run), then forks a copy of
itself for each rank a launcher starts, and for the launchers that import torch themselves (torchrun, DeepSpeed's
runner). The rank's (or launcher's) own process, started as always, hands its argv, environment, working directory
and standard streams over in sitecustomize.py here, waits for the copy and ends as it ended (exit code or signal),
passing on the signals it receives.

    python tests/warm_start/zygote.py SOCKET_PATH [MODULE...]

prints {"ready": <the variables its imports set>} once it listens; "retire" on stdin: no more requests, it ends after
its last copy; stdin closed: it kills its copies and ends.

A copy runs trainer/main.py exactly as a fresh interpreter would (runpy, `__main__`; its end skips only the
interpreter's teardown: run_and_exit), in a session of its own; when the rank's own process dies (SIGKILL included)
the copy's session is killed. A request whose environment differs from the server's in anything a module imported
here may have read at import time is declined, and that rank starts cold.
Only the standard library at module level: the heavy imports run in warm_imports(), in the server alone."""
import atexit
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading

# Variables a launcher sets per rank or per launch (torchrun, Tessera's torchrun wrapper, the deepspeed launcher,
# which sets PYTORCH_NVML_BASED_CUDA_CHECK and CUDA_VISIBLE_DEVICES), and the tests' own: read at run time (by the
# process group, torch.cuda's first call, the elastic agent or Tessera's modules, none of them imported here),
# never by the imports below; and MLflow's telemetry session id, which a process that imported MLflow (peft does)
# passes on.
PER_LAUNCH = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
              "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE",
              "CUDA_VISIBLE_DEVICES", "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
              "_MLFLOW_TELEMETRY_SESSION_ID",
              "PATH", "PYTHONPATH", "PWD", "OLDPWD", "_", "SHLVL")
PER_LAUNCH_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_", "TESSERA_", "PYTEST_", "TORCH_NCCL_", "NCCL_")
IMPORT_SET = {}  # environment variables warm_imports() set
WAKE_FDS = []  # the server's SIGCHLD pipe, which a copy closes
READY_FD = []  # the pipe tests/warm.py reads the "ready" line from


# What every rank of trainer/main.py imports, whatever its strategy (not DeepSpeed, peft or trackers, which some
# import and others must not find imported).
WARM_MODULES = ("numpy", "torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor",
                "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
                "transformers.models.llama.modeling_llama", "hydra", "omegaconf", "safetensors.torch")


def warm_imports(extra=()) -> None:
    """WARM_MODULES and `extra` (tests/warm.py's flavours: deepspeed, peft for the runs that import them), and
    transformers' table of checkpoint conversions, which the first save_pretrained or from_pretrained of a process
    builds (1,100 renaming rules, their regular expressions compiled: 0.5 s of CPU; a module-level cache, the same
    in every process, that lookups copy)."""
    for name in WARM_MODULES + tuple(extra):
        importlib.import_module(name)
    conversions = importlib.import_module("transformers.conversion_mapping")
    if hasattr(conversions, "get_checkpoint_conversion_mapping"):
        conversions.get_checkpoint_conversion_mapping("llama")


def import_time_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in PER_LAUNCH and not k.startswith(PER_LAUNCH_PREFIXES)}


def differing(env: dict, server_env: dict, import_set: dict) -> list:
    """The variables a server started with `server_env` (before its imports, which set `import_set`) saw otherwise
    than a fresh process's imports would with `env`. A variable the imports set is the same for both when `env`
    holds the value they set (a process that imported them before, such as pytest's, passes it on)."""
    theirs, ours = import_time_env(env), import_time_env(server_env)
    return sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k) and not (
        k not in ours and k in import_set and theirs.get(k) == import_set[k]))


def decline_reason(request: dict, own_env: dict) -> str:
    """Why a request cannot be served warm ('' when it can): a difference the imports here could have seen."""
    keys = differing(request["env"], own_env, IMPORT_SET)
    if keys:
        return "environment differs in " + ", ".join(keys)
    if request["executable"] != sys.executable or request["flags"] != list(sys.flags)[:len(request["flags"])]:
        return "another interpreter or other interpreter flags"
    return ""


def receive(conn):
    """One request (a JSON line) and the three standard streams passed with it (SCM_RIGHTS)."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * 4))
        if not msg:
            raise EOFError
        data += msg
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(memoryview(payload).cast("i"))
    return json.loads(data), fds


def become(request: dict, fds: list, listener, conns) -> None:
    """In the forked copy: take over the rank's streams, directory, environment and command line."""
    listener.close()
    for conn in conns:
        conn.close()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in WAKE_FDS:
        os.close(fd)
    os.setsid()  # as torchrun starts its ranks; the server kills this session when the rank's process dies
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in IMPORT_SET.items():  # as a fresh process's imports would have set them (an inductor cache)
        os.environ.setdefault(key, value)
    os.umask(request["umask"])
    sys.argv, sys.orig_argv = request["argv"], request["orig_argv"]
    # sys.path[0] as the interpreter sets it: the script's folder, or for `-m` the working directory
    first = request["cwd"] if request.get("module") else os.path.dirname(os.path.abspath(request["argv"][0]))
    sys.path[:] = [first] + request["path"]


def serve(path: str, own_env: dict):
    """Accept requests (`own_env`: the environment before the imports) until stdin says "retire" (then end once the
    last copy has ended) or closes (then kill the copies and end). Returns the request in a forked copy, None in the
    server."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    WAKE_FDS[:] = [wake_r, wake_w]
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children = {}  # conn -> (child pid, the test that started it)
    with os.fdopen(READY_FD.pop(), "w") as ready_pipe:
        ready_pipe.write(json.dumps({"ready": IMPORT_SET}) + "\n")
    retired = False
    while not (retired and not children):
        ready, _, _ = select.select([wake_r, sys.stdin] + ([] if retired else [listener]) + list(children), [], [])
        if sys.stdin in ready:
            said = os.read(sys.stdin.fileno(), 1024)
            if not said:
                for pid, _ in children.values():  # the tests are over: nothing they started outlives them
                    kill_session(pid)
                return None
            if b"retire" in said and not retired:
                retired = True
                listener.close()  # a rank's process still waiting to be accepted reads EOF and starts cold
                os.unlink(path)
        if wake_r in ready:
            os.read(wake_r, 1024)
            reap(children)
        for conn in [c for c in ready if c in children]:
            if not conn.recv(1024):  # the rank's own process died: so does its copy, with what it started
                kill_session(children.pop(conn)[0])
                conn.close()
        if listener in ready and not retired:
            conn, _ = listener.accept()
            forked = handle(conn, own_env, listener, children)
            if forked is not None:
                return forked
    return None


def handle(conn, own_env: dict, listener, children):
    try:
        request, fds = receive(conn)
    except (EOFError, OSError, ValueError):
        conn.close()
        return None
    why = decline_reason(request, own_env)
    if why:
        log("declined.log", {"argv": request["argv"], "why": why})
        conn.sendall(json.dumps({"cold": why}).encode() + b"\n")
        conn.close()
        for fd in fds:
            os.close(fd)
        return None
    pid = os.fork()
    if pid == 0:
        become(request, fds, listener, list(children) + [conn])
        return request
    for fd in fds:
        os.close(fd)
    children[conn] = (pid, request["env"].get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0])
    log("served.log", {"argv": request["argv"], "module": request.get("module"), "pid": pid})
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return None


def log(name: str, record: dict) -> None:
    """One line in the server's folder, beside its socket (tests/warm.py: served(), declined(), cpu_seconds())."""
    with open(os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), name), "a") as fh:
        fh.write(json.dumps(record) + "\n")


def reap(children) -> None:
    for conn, (pid, test) in list(children.items()):
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            del children[conn]
            log("cpu.log", {"test": test, "cpu_s": usage.ru_utime + usage.ru_stime})
            end = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}
            try:
                conn.sendall(json.dumps(end).encode() + b"\n")
            except OSError:
                pass
            conn.close()


def run_and_exit(module) -> None:
    """Run the copy's script (or `-m` module) as the interpreter would, then end as it would, less its teardown:
    the interpreter's own end (non-daemon threads joined, atexit functions, streams flushed) and then os._exit. The
    teardown (every module and object freed) costs 0.5 s of CPU in a process holding torch, more than a tiny run's
    steps. An exception other than SystemExit ends as usual (traceback, teardown)."""
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code
    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, exit 1
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)


def kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


if __name__ == "__main__":
    _env_before = dict(os.environ)
    READY_FD.append(os.dup(1))  # the "ready" line's pipe; what the imports print (DeepSpeed does) goes to stderr
    os.dup2(2, 1)
    warm_imports(sys.argv[2:])
    IMPORT_SET.update({k: v for k, v in os.environ.items() if k not in _env_before})
    gc.collect()
    gc.freeze()  # the copies share these pages instead of touching them in every collection
    _forked = serve(sys.argv[1], _env_before)
    if _forked is None:
        sys.exit(0)
    _module = _forked.get("module")
    del _forked, _env_before
    # The copy: trainer/main.py (or a launcher) as a script, or a launcher module as `-m` runs it (its file in
    # argv[0]), from here: nothing of the server's loop is on the stack any more.
    run_and_exit(_module)
