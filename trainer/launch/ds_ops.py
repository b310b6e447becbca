"""DeepSpeed's C++ ops that a ZeRO run loads, ready before the run needs them.

On a CPU machine DeepSpeed's communication backend JIT-builds its shared-memory op (`deepspeed_shm_comm`) the
first time a ZeRO run starts: minutes of compilation on a small machine. launch.sh builds it when it sets up the
environment (`python -m trainer.ds_ops build`), and a run that still has to build it says so, with progress.

Each virtual environment builds its ops in its own folder, <venv>/torch_extensions/<py_cu tag>/<op>
(TORCH_EXTENSIONS_DIR, when set, wins; outside a venv torch's ~/.cache/torch_extensions/<py_cu tag>/<op>): ops
built from two installs of DeepSpeed in one shared folder made each ZeRO run of the other rebuild them. The ops
are built by the environment's own ninja (first on PATH), whichever shell or launcher started the run: two ninja
versions hash the build commands differently and rebuild each other's ops.

torch builds an extension under a file lock (`FileBaton`: a file named `lock` in the extension's build folder). A
build that was interrupted leaves that file behind and every later run waits on it forever. Before DeepSpeed can
block on it, a lock that no live process is building under (no process works in or names the folder, and neither the
lock nor anything in the folder changed for TESSERA_BUILD_LOCK_GRACE_S seconds, default 60) is reported as a stale
lock: exit 2, naming the file to remove.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, List, Optional

from tessera.errors import TesseraError

SHM_COMM = "deepspeed_shm_comm"
AIO = "async_io"
TICK_S = 30.0  # progress line period while an op builds


class BuildLockError(TesseraError):
    """A build lock left by an interrupted build (exit 2)."""


def lock_grace_s() -> float:
    return float(os.environ.get("TESSERA_BUILD_LOCK_GRACE_S", "60"))


def needed_ops(offload_nvme: bool = False, cuda: Optional[bool] = None) -> List[str]:
    """The JIT-built ops a Tessera ZeRO run loads on this machine: the shared-memory comm op on a CPU-only Linux
    machine (NCCL needs none), DeepSpeed's async I/O op for NVMe offload. Tessera's own optimizer runs on every
    backend, so no DeepSpeed optimizer op is ever built."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    names = []
    if not cuda and sys.platform.startswith("linux"):
        names.append(SHM_COMM)
    if offload_nvme:
        names.append(AIO)
    return names


def _accelerator_tag() -> str:
    """torch's folder tag for JIT extensions: py311_cpu, py311_cu128, ..."""
    import torch

    if torch.version.hip is not None:
        acc = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        acc = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        acc = "cpu"
    return f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{acc}"


def environment_root() -> Optional[str]:
    """The build root of this virtual environment's ops, <venv>/torch_extensions/<tag>; None outside a venv or in
    one this user can't write."""
    if sys.prefix == sys.base_prefix or not os.access(sys.prefix, os.W_OK):
        return None
    return os.path.join(sys.prefix, "torch_extensions", _accelerator_tag())


def use_environment_root() -> None:
    """Build and load DeepSpeed's ops in this venv's own folder unless TORCH_EXTENSIONS_DIR says otherwise, with
    this venv's ninja (use_environment_ninja); the processes this one starts inherit both. torch's default folder
    is shared by every environment of the user, and an op built from another install's DeepSpeed (another clone or
    venv) does not match this one's: each ZeRO run rebuilt it for minutes, alternately for each environment."""
    root = None if os.environ.get("TORCH_EXTENSIONS_DIR") else environment_root()
    if root:
        os.environ["TORCH_EXTENSIONS_DIR"] = root
    use_environment_ninja()


def use_environment_ninja() -> None:
    """The environment's own ninja first on PATH (torch runs `ninja` from PATH), as an activated venv has it.
    DeepSpeed installs pip's ninja (1.13) into the environment and the system may have another (Debian's 1.11): the
    two hash a build command differently, so an op last built by one is rebuilt by the other (measured: every
    2-rank ZeRO-2 launch 34 s instead of 7.5 s while launch.sh, whose PATH starts with the venv, and a shell's
    torchrun took turns; a test suite's ZeRO runs rebuilt it for the same reason)."""
    bin_dir = os.path.dirname(sys.executable)
    if not os.access(os.path.join(bin_dir, "ninja"), os.X_OK):
        return
    parts = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    if parts[:1] != [bin_dir]:
        os.environ["PATH"] = os.pathsep.join([bin_dir] + [p for p in parts if p != bin_dir])


def extensions_root() -> str:
    """torch's JIT extension root (torch.utils.cpp_extension._get_build_directory without creating it)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    from torch.utils.cpp_extension import get_default_build_root

    return os.path.join(get_default_build_root(), _accelerator_tag())


def build_dir(name: str) -> str:
    return os.path.join(extensions_root(), name)


def builders(folder: str) -> List[int]:
    """Live processes (other than this one) working in `folder` (ninja and the compilers run there) or naming it
    on their command line."""
    folder = os.path.realpath(folder)
    found = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            cwd = os.path.realpath(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            cwd = ""
        if cwd == folder or cwd.startswith(folder + os.sep):
            found.append(pid)
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if folder.encode() in fh.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def _last_change(folder: str) -> float:
    latest = 0.0
    try:
        for entry in os.scandir(folder):
            try:
                latest = max(latest, entry.stat(follow_symlinks=False).st_mtime)
            except OSError:
                pass
    except OSError:
        pass
    return latest


def lock_state(name: str, now: Optional[float] = None, grace: Optional[float] = None) -> tuple:
    """(lock path, state): "none" (no lock), "live" (a process is building), "recent" (no builder seen, but the
    lock or the folder changed within the grace period: a build may be starting) or "stale".

    Every process that loads the op takes the lock for a moment (torch runs a no-op ninja under it), so the
    lock is stat'ed before anything else and must still be the same file afterwards: a lock released while it
    is judged is not stale."""
    folder = build_dir(name)
    lock = os.path.join(folder, "lock")
    try:
        seen = os.stat(lock)
    except OSError:
        return lock, "none"
    if builders(folder):
        return lock, "live"
    now = time.time() if now is None else now
    grace = lock_grace_s() if grace is None else grace
    if now - max(seen.st_mtime, _last_change(folder)) < grace:
        return lock, "recent"
    try:
        again = os.stat(lock)
    except OSError:
        return lock, "none"
    if (again.st_ino, again.st_mtime_ns) != (seen.st_ino, seen.st_mtime_ns):
        return lock, "recent"  # released and taken again while it was judged
    return lock, "stale"


def stale_message(name: str, lock: str) -> str:
    return (f"DeepSpeed's {name} op cannot load: its build folder holds the lock file {lock}, left by an "
            f"interrupted build (no process is building it); DeepSpeed would wait on it forever. Remove it "
            f"(rm {lock}) and start again")


def check_locks(names, grace: Optional[float] = None) -> None:
    """Raise BuildLockError for the first op whose build lock is stale."""
    for name in names:
        lock, state = lock_state(name, grace=grace)
        if state == "stale":
            raise BuildLockError(stale_message(name, lock))


def wait_for_locks(names, say: Callable[[str], None], grace: Optional[float] = None, poll: float = 1.0) -> None:
    """Wait while another process builds an op (saying so every TICK_S seconds); raise BuildLockError as soon
    as a lock is stale."""
    for name in names:
        t0 = last = time.time()
        while True:
            lock, state = lock_state(name, grace=grace)
            if state == "none":
                break
            if state == "stale":
                raise BuildLockError(stale_message(name, lock))
            if time.time() - last >= TICK_S:
                last = time.time()
                say(f"waiting for another process building DeepSpeed's {name} op ({last - t0:.0f} s; lock {lock})")
            time.sleep(poll)


def _builder(name: str):
    from deepspeed.accelerator import get_accelerator

    cls = {SHM_COMM: "ShareMemCommBuilder", AIO: "AsyncIOBuilder"}[name]
    return get_accelerator().create_op_builder(cls)


def load(names, say: Callable[[str], None], announce_after: float = 5.0) -> None:
    """Load (building when needed) each op the way DeepSpeed does; DeepSpeed reuses the loaded module. A build
    is announced after `announce_after` seconds, then every TICK_S seconds; a build lock that goes stale while
    this process waits ends it with exit 2."""
    for name in names:
        builder = _builder(name)
        if builder is None or not builder.is_compatible(False):
            continue
        folder, done = build_dir(name), threading.Event()

        def progress(name=name, folder=folder, done=done):
            t0 = time.time()
            if done.wait(announce_after):
                return
            say(f"building DeepSpeed's {name} C++ op in {folder} (once per machine; minutes on a small CPU) ...")
            last = time.time()
            while not done.wait(5.0):
                lock, state = lock_state(name)
                if state == "stale":  # the process that held the lock died: torch would wait forever
                    print(f"error: {stale_message(name, lock)}", file=sys.stderr, flush=True)
                    os._exit(BuildLockError.exit_code)
                if time.time() - last >= TICK_S:
                    last = time.time()
                    say(f"still building DeepSpeed's {name} op ({last - t0:.0f} s)")

        ticker = threading.Thread(target=progress, daemon=True)
        t0 = time.time()
        ticker.start()
        try:
            builder.load(verbose=False)
        finally:
            done.set()
        if time.time() - t0 > announce_after:
            say(f"DeepSpeed's {name} op is ready ({time.time() - t0:.0f} s)")


def ensure_ready(cfg=None) -> None:
    """For a ZeRO rank, before DeepSpeed loads its ops: fail fast on a stale build lock, wait (with progress) for
    a build another process runs, build what is missing with progress. Local rank 0 speaks for the node."""
    use_environment_root()
    offload_nvme = cfg is not None and "nvme" in (getattr(cfg.strategy, "offload_optimizer", ""),
                                                  getattr(cfg.strategy, "offload_param", ""))
    names = needed_ops(offload_nvme=offload_nvme)
    if not names:
        return
    speaker = os.environ.get("LOCAL_RANK", "0") == "0"

    def say(msg):
        if speaker:
            print(msg, file=sys.stderr, flush=True)

    wait_for_locks(names, say)
    load(names, say)


def main(argv) -> int:
    """`python -m trainer.ds_ops build`: build the ops this machine's ZeRO runs need (launch.sh's set-up);
    `python -m trainer.ds_ops check`: exit 2 with a message when a stale build lock would block a ZeRO run."""
    cmd = argv[0] if argv else "build"

    def say(msg):
        print(f"launch.sh: {msg}", file=sys.stderr, flush=True)

    use_environment_root()
    try:
        names = needed_ops()
        if cmd == "check":
            check_locks(names)
            return 0
        if cmd != "build":
            print("usage: python -m trainer.ds_ops [build|check]", file=sys.stderr)
            return 2
        wait_for_locks(names, say)
        # Always through DeepSpeed's loader: a build folder may hold an op built from another install's sources
        # (another clone or venv), which the loader rebuilds; an up-to-date op just loads (a second or two).
        load(names, say, announce_after=3.0)
    except TesseraError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
