#!/usr/bin/env python
"""Checkpoint save/load throughput of the Tessera trainer against the disk's own sequential speed, and the
training-step blocking time of a synchronous vs an asynchronous save.

    python benchmarks/bench_checkpoint.py                           # llama_10m + AdamW state, 3 repeats
    python benchmarks/bench_checkpoint.py --model llama_100m --dir /scratch --out /tmp/c.json
    python benchmarks/bench_checkpoint.py --quick --out /tmp/c.json # a tiny model, 1 repeat (the smoke test)

Everything runs in this one process, with strategy=single, on one target folder (--dir):

* Two runs are built the way trainer/main.py builds them (Hydra compose of conf/, trainer.build.prepare ->
  build), one with checkpoint.async_save=false ("sync") and one with checkpoint.async_save=true ("async"), and
  each trains 2 steps through trainer.loop.fit (checkpoints off during fit), so that AdamW holds both moments:
  a checkpoint is the weights + 2 moments (+ the small JSON / RNG / HF-config files).
* Warm-up (not counted): one save of each run and one load, which also checks that a load restores the saved
  weights and that an async checkpoint holds the state of the moment save() was called (the weights are
  changed in place right after save() returns, before the background write ends).
* Each repeat then measures, in this order (sync and async swap places every other repeat, so drift in the
  machine's load hits both alike):
    disk     write a file of the checkpoint's size in 8 MiB chunks + fsync (timed), read it back at once
             ("cached": from the page cache), evict it with posix_fadvise(POSIX_FADV_DONTNEED) and read it
             again ("cold"); the page-cache residency (mincore) after the eviction is reported;
    sync     run.checkpointer.save(step) + wait(): the step is blocked for the whole save;
    load     run.checkpointer.load(path, weights_only=False) of that checkpoint, after evicting its files from
             the page cache ("cold"), then again at once ("cached");
    async    save(step) with checkpoint.async_save=true: the time save() blocks (the manager's blocking_s);
             then poll() is called every millisecond, as the training loop calls it after every step, and the
             one poll() call that finalizes the checkpoint (COMPLETE.json, rename, retention) is timed too, as
             that work also runs on the training thread; and the time until the checkpoint is complete.
* Figures are medians over the repeats; MB = 10^6 bytes. Save MB/s = checkpoint bytes on disk / (save + wait)
  wall seconds (the manager's own total_s is shown too); load MB/s = the same bytes / load seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 8 * 2**20
MB = 1e6

# The run that is checkpointed: a short, cheap training run (the checkpoint's size depends on the model only).
RUN_OVERRIDES = [
    "strategy=single", "optim=adamw", "precision=fp32", "scheduler=constant", "scheduler.warmup_steps=0",
    "data.embedded_documents=400", "data.seq_len=64", "train.global_batch_size=2", "train.micro_batch_size=2",
    "train.max_steps=2", "train.log_every=1", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false",
    "logging.progress=false", "logging.tensorboard=false", "checkpoint.every=0", "checkpoint.at_end=false",
    "checkpoint.resume=none", "checkpoint.keep_last=2",
]
QUICK_MODEL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
               "model.num_kv_heads=2", "model.intermediate_size=128", "data.seq_len=32"]


# ---------------------------------------------------------------------------------------------------------------
# Page cache: eviction and residency
# ---------------------------------------------------------------------------------------------------------------
def evict(path: str) -> bool:
    """fsync a file (dirty pages cannot be dropped) and ask the kernel to drop its cached pages."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def resident(path: str):
    """(resident bytes, file bytes) of a file in the page cache, via mmap + mincore; None where unavailable."""
    size = os.path.getsize(path)
    if _LIBC is None or size == 0:
        return None if _LIBC is None else (0, 0)
    import mmap

    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if _LIBC.mincore(addr, size, vec) != 0:
                return None
            return min(size, sum(v & 1 for v in vec) * page), size
        finally:
            _LIBC.munmap(addr, size)
    finally:
        os.close(fd)


def files_under(folder: str) -> list:
    return [os.path.join(base, f) for base, _, names in os.walk(folder) for f in names]


def evict_tree(folder: str):
    """Evict every file of a folder; -> the resident fraction afterwards (None if it cannot be measured)."""
    paths = files_under(folder)
    if not all([evict(p) for p in paths]):
        return None
    counts = [resident(p) for p in paths]
    if any(c is None for c in counts):
        return None
    return _fraction((sum(c[0] for c in counts), sum(c[1] for c in counts)))


def _fraction(count):
    return None if count is None or count[1] == 0 else count[0] / count[1]


# ---------------------------------------------------------------------------------------------------------------
# The disk alone
# ---------------------------------------------------------------------------------------------------------------
def write_file(path: str, nbytes: int, block: bytes):
    """Write `nbytes` sequentially in chunks of len(block), then fsync -> (write() seconds, fsync seconds)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[:left] if left < len(block) else block)
        t1 = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    return t1 - t0, time.perf_counter() - t1


def read_file(path: str, nbytes: int, view: memoryview) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        total = 0
        while True:
            n = os.readv(fd, [view])
            if n <= 0:
                break
            total += n
    finally:
        os.close(fd)
    if total != nbytes:
        raise RuntimeError(f"read {total} bytes of {nbytes} from {path}")
    return time.perf_counter() - t


def disk_once(folder: str, nbytes: int, tag: str) -> dict:
    """Two sequential writes (+ fsync) of `nbytes` in 8 MiB chunks: the first is reported apart (on a VM it
    often runs into memory the guest has not touched lately, which is slow to hand out), the second is the
    figure; then a read straight after (page cache) and a read after evicting the file from the page cache."""
    path = os.path.join(folder, f"disk-test-{tag}.bin")
    block = os.urandom(min(CHUNK, max(nbytes, 1)))
    view = memoryview(bytearray(CHUNK))
    try:
        first = sum(write_file(path, nbytes, block))
        os.remove(path)
        write_s, fsync_s = write_file(path, nbytes, block)
        before = _fraction(resident(path))
        cached_s = read_file(path, nbytes, view)
        evicted = evict(path)
        after = _fraction(resident(path))
        cold_s = read_file(path, nbytes, view)
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
    total = write_s + fsync_s
    return {"bytes": nbytes, "write_s": total, "write_calls_s": write_s, "fsync_s": fsync_s,
            "read_cached_s": cached_s, "read_cold_s": cold_s, "first_write_s": first,
            "write_mb_s": nbytes / total / MB, "first_write_mb_s": nbytes / first / MB,
            "read_cached_mb_s": nbytes / cached_s / MB, "read_cold_mb_s": nbytes / cold_s / MB,
            "fadvise_dontneed": evicted, "resident_after_write": before, "resident_after_evict": after}


# ---------------------------------------------------------------------------------------------------------------
# The trainer's checkpoints
# ---------------------------------------------------------------------------------------------------------------
class Quiet:
    """Collects the trainer's own output (log lines go to stderr, data messages to stdout) unless --verbose;
    shown when something fails."""

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.log = io.StringIO()

    @contextlib.contextmanager
    def __call__(self):
        if self.verbose:
            yield
            return
        with contextlib.redirect_stdout(self.log), contextlib.redirect_stderr(self.log):
            yield

    def tail(self, n: int = 4000) -> str:
        return self.log.getvalue()[-n:]


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from trainer.cli import register_resolvers
    from trainer.config import register_configs, to_object

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        return to_object(hydra_compose(config_name="config", overrides=list(overrides)))


def build_run(overrides, run_dir: str):
    from trainer import build as B
    from trainer.loop import fit

    cfg = compose(overrides)
    run = B.build(B.prepare(cfg, run_dir))
    try:
        fit(run)  # train.max_steps steps: AdamW's moments exist afterwards
    except BaseException:
        B.close(run, graceful=False)
        raise
    return run


def tensor_bytes(run) -> int:
    import torch

    total = 0

    def walk(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(run.strategy.checkpoint_state())
    return total


def first_param(run):
    name, p = next(iter(run.strategy.unwrapped().named_parameters()))
    return name, p


def timed_save(run, step: int, poll: bool = False) -> dict:
    """save(step), then wait() (or, with poll, call poll() every millisecond as the training loop calls it once
    per step, until the save is finalized): the time save() blocks the caller, the time of the poll() call that
    finalizes an async save (also spent on the training thread), and the time until the checkpoint is complete."""
    cp = run.checkpointer
    n = len(cp.stats)
    t0 = time.perf_counter()
    cp.save(step)
    t1 = time.perf_counter()
    finalize_s = None
    if poll and hasattr(cp, "pending"):
        while cp.pending is not None:
            tp = time.perf_counter()
            cp.poll()
            if cp.pending is None:
                finalize_s = time.perf_counter() - tp
                break
            time.sleep(0.001)
    cp.wait()
    t2 = time.perf_counter()
    if len(cp.stats) != n + 1 or cp.stats[-1].get("step") != step or "bytes" not in cp.stats[-1]:
        raise RuntimeError(f"checkpointer.save({step}) left no complete stats record: {cp.stats[n:]}")
    rec = dict(cp.stats[-1])
    path = os.path.join(cp.root, f"step_{step}")
    if not os.path.isdir(path):
        raise RuntimeError(f"checkpointer.save({step}) did not produce {path}")
    return {"step": step, "path": path, "bytes": rec["bytes"], "call_s": t1 - t0, "wall_s": t2 - t0,
            "finalize_in_poll_s": finalize_s, "manager_blocking_s": rec.get("blocking_s"),
            "manager_total_s": rec.get("total_s"), "checksum_s": rec.get("checksum_s"),
            "files": len(files_under(path))}


def timed_load(run, path: str, cold: bool) -> dict:
    resident_after = evict_tree(path) if cold else None
    t0 = time.perf_counter()
    run.checkpointer.load(path, weights_only=False)
    return {"s": time.perf_counter() - t0, "resident_before": resident_after}


def warm_up(runs, quiet: Quiet, steps) -> dict:
    """One save of each run and one load (not counted), with two correctness checks."""
    import torch

    sync, asyn = runs["sync"], runs["async"]
    with quiet():
        s = timed_save(sync, next(steps))
        name, p = first_param(sync)
        saved = p.detach().clone()
        with torch.no_grad():
            p.add_(1.0)
        timed_load(sync, s["path"], cold=False)
        load_restores = bool(torch.equal(first_param(sync)[1].detach(), saved))

        # async: change the weights in place as soon as save() returns, before its background write completes
        cp = asyn.checkpointer
        _, pa = first_param(asyn)
        at_save = pa.detach().clone()
        step = next(steps)
        t0 = time.perf_counter()
        cp.save(step)
        call_s = time.perf_counter() - t0
        with torch.no_grad():
            pa.add_(1.0)
        pending = getattr(cp, "pending", None)
        in_flight = pending is not None and not pending[0].done()
        cp.wait()
        a_path = os.path.join(cp.root, f"step_{step}")
        cp.load(a_path, weights_only=False)
        async_snapshot = bool(torch.equal(first_param(asyn)[1].detach(), at_save))
    return {"sync_save": s, "async_call_s": call_s, "load_restores_weights": load_restores,
            "async_holds_state_at_save": async_snapshot, "async_write_still_running_after_change": in_flight,
            "checked_tensor": name}


def measure(a, quiet: Quiet) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    from trainer import build as B

    work = tempfile.mkdtemp(prefix="tessera-bench-ckpt-", dir=a.dir)
    runs = {}
    base = RUN_OVERRIDES + [f"model={a.model}"] + (QUICK_MODEL if a.quick else []) + list(a.set)
    steps = iter(range(1000, 10**9))  # save step numbers: never 2 (fit's last step), never repeated
    result = {"work_dir": work}
    try:
        t0 = time.perf_counter()
        with quiet():
            for mode in ("sync", "async"):
                runs[mode] = build_run(base + [f"checkpoint.async_save={str(mode == 'async').lower()}"],
                                       os.path.join(work, mode))
        run = runs["sync"]
        info = {"num_params": run.num_params, "model_desc": run.model_desc, "device": str(run.device),
                "tensor_bytes": tensor_bytes(run), "threads": torch.get_num_threads(),
                "optimizer": type(run.strategy.optimizer).__name__,
                "optimizer_state_tensors": sum(len(v) for v in run.strategy.optimizer.state.values())}
        print(f"built and trained 2 steps on both runs in {time.perf_counter() - t0:.1f} s: {run.model_desc}, "
              f"device {run.device}, {info['tensor_bytes'] / 2**20:.1f} MiB of tensors (weights + AdamW moments)",
              flush=True)

        # Room for 2 runs x (keep_last=2 checkpoints + 1 being written) + the disk test file, with a margin.
        need, free = 8 * info["tensor_bytes"], shutil.disk_usage(work).free
        if free < need:
            raise SystemExit(f"bench_checkpoint: {work} has {free / 2**30:.1f} GiB free, about "
                             f"{need / 2**30:.1f} GiB are needed; pick another --dir")
        wu = warm_up(runs, quiet, steps)
        nbytes = wu["sync_save"]["bytes"]
        info["checkpoint_bytes"] = nbytes
        info["checkpoint_files"] = wu["sync_save"]["files"]
        print(f"warm-up: checkpoint {nbytes / 2**20:.1f} MiB in {wu['sync_save']['files']} files; first save "
              f"{wu['sync_save']['wall_s']:.2f} s; load restores the weights: {wu['load_restores_weights']}; async "
              f"checkpoint holds the state at save(): {wu['async_holds_state_at_save']}", flush=True)

        rows = {"disk": [], "sync": [], "load_cold": [], "load_cached": [], "async": []}
        for i in range(a.repeats):
            load = os.getloadavg()[0]
            d = disk_once(work, nbytes, str(i))
            rows["disk"].append(d)
            order = ("sync", "async") if i % 2 == 0 else ("async", "sync")
            with quiet():
                for mode in order:
                    r = timed_save(runs[mode], next(steps), poll=mode == "async")
                    rows[mode].append(r)
                    if mode == "sync":
                        rows["load_cold"].append(timed_load(runs["sync"], r["path"], cold=True))
                        rows["load_cached"].append(timed_load(runs["sync"], r["path"], cold=False))
            s, y = rows["sync"][-1], rows["async"][-1]
            lc = rows["load_cold"][-1]
            print(f"  repeat {i + 1}: disk write {d['write_mb_s']:.0f} MB/s (first {d['first_write_mb_s']:.0f}), "
                  f"read cold {d['read_cold_mb_s']:.0f} / cached {d['read_cached_mb_s']:.0f} MB/s | sync save "
                  f"{s['wall_s']:.3f} s | load cold {lc['s']:.3f} s, cached {rows['load_cached'][-1]['s']:.3f} s | async save blocks "
                  f"{y['manager_blocking_s']:.3f} s (+ {y['finalize_in_poll_s'] or 0:.3f} s in poll), done after "
                  f"{y['wall_s']:.3f} s | load avg before {load:.2f}", flush=True)
    except BaseException:
        if not a.verbose:
            sys.stderr.write("bench_checkpoint: failed; the trainer's output so far:\n" + quiet.tail() + "\n")
        raise
    finally:
        with quiet():
            for mode in ("async", "sync"):  # the reverse of the build order (signal handlers are restored)
                if mode in runs:
                    B.close(runs[mode])
        if a.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    disk = rows["disk"]
    sizes = {r["bytes"] for r in rows["sync"] + rows["async"]}
    sync_block = med(r["wall_s"] for r in rows["sync"])
    async_block = med(r["manager_blocking_s"] for r in rows["async"])
    result.update({
        "disk": {"bytes": nbytes, "chunk_bytes": CHUNK,
                 "write_mb_s": med(d["write_mb_s"] for d in disk),
                 "write_s": med(d["write_s"] for d in disk), "fsync_s": med(d["fsync_s"] for d in disk),
                 "first_write_mb_s": med(d["first_write_mb_s"] for d in disk),
                 "read_cold_mb_s": med(d["read_cold_mb_s"] for d in disk),
                 "read_cached_mb_s": med(d["read_cached_mb_s"] for d in disk),
                 "eviction": "fsync + posix_fadvise(POSIX_FADV_DONTNEED) on the file (no root-only drop_caches)",
                 "resident_after_evict": [d["resident_after_evict"] for d in disk],
                 "runs": disk},
        "save_s": sync_block, "save_mb_s": nbytes / sync_block / MB,
        "save_manager_total_s": med(r["manager_total_s"] for r in rows["sync"]),
        "checksum_s": med(r["checksum_s"] for r in rows["sync"]),
        "load_s": med(r["s"] for r in rows["load_cold"]),
        "load_mb_s": nbytes / med(r["s"] for r in rows["load_cold"]) / MB,
        "load_cached_s": med(r["s"] for r in rows["load_cached"]),
        "load_cached_mb_s": nbytes / med(r["s"] for r in rows["load_cached"]) / MB,
        "load_resident_before": [r["resident_before"] for r in rows["load_cold"]],
        "blocking": {"sync_blocking_s": sync_block, "async_blocking_s": async_block,
                     "async_call_s": med(r["call_s"] for r in rows["async"]),
                     "async_total_s": med(r["wall_s"] for r in rows["async"]),
                     "async_finalize_in_poll_s": _median_or_none(r["finalize_in_poll_s"] for r in rows["async"]),
                     "async_manager_total_s": med(r["manager_total_s"] for r in rows["async"]),
                     "ratio_async_over_sync": async_block / sync_block if sync_block > 0 else float("nan")},
        "checkpoint_sizes_seen": sorted(sizes),
        "model": info, "warm_up": wu, "runs": rows,
    })
    return result


def _median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="preset in conf/model (default llama_10m; --quick: tiny, shrunk)")
    ap.add_argument("--dir", default=None,
                    help="target folder: a fresh subfolder is made in it for the checkpoints and the disk test "
                         "file, and removed at the end (default: the repository's outputs/, where runs write)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 1)")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS and torch threads (default: $OMP_NUM_THREADS, else the CPU count)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra Hydra override for both runs, e.g. --set train.device=cpu (repeatable)")
    ap.add_argument("--quick", action="store_true", help="a tiny model and 1 repeat (the smoke test)")
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (checkpoints, run logs)")
    ap.add_argument("--verbose", action="store_true", help="show the trainer's own output")
    a = ap.parse_args(argv)
    if a.model is None:
        a.model = "tiny" if a.quick else "llama_10m"
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    if a.threads is None:
        a.threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    if a.dir is None:
        a.dir = os.path.join(ROOT, "outputs")
    a.dir = os.path.abspath(os.path.expanduser(a.dir))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    # Before torch is imported: the trainer leaves the thread count alone when OMP_NUM_THREADS is set.
    os.environ.update(OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false")
    sys.path.insert(0, ROOT)
    os.makedirs(a.dir, exist_ok=True)
    print(f"model {a.model}{' (quick: shrunk)' if a.quick else ''} | strategy single | AdamW | target {a.dir} | "
          f"{a.repeats} repeat(s) | OMP_NUM_THREADS={a.threads}", flush=True)
    quiet = Quiet(a.verbose)
    r = measure(a, quiet)
    d, b, m = r["disk"], r["blocking"], r["model"]
    mib = m["checkpoint_bytes"] / 2**20
    ev = [x for x in d["resident_after_evict"] if x is not None]
    ev_txt = (f"page-cache residency after eviction {max(ev) * 100:.0f}% (mincore)" if ev else
              "residency after eviction not measurable")
    lr = [x for x in r["load_resident_before"] if x is not None]

    print()
    print(f"checkpoint: {mib:.1f} MiB ({m['checkpoint_bytes'] / MB:.1f} MB) in {m['checkpoint_files']} files; "
          f"{m['num_params'] / 1e6:.2f}M params, {m['tensor_bytes'] / 2**20:.1f} MiB of tensors "
          f"(weights + 2 AdamW moments, {m['optimizer_state_tensors']} state tensors), {m['threads']} torch threads")
    print(f"{'':34s}{'median':>12s}   runs")
    row = lambda label, v, unit, runs: print(f"{label:34s}{v:9.1f} {unit:5s}  " + " ".join(f"{x:.1f}" for x in runs))
    row("disk sequential write + fsync", d["write_mb_s"], "MB/s", [x["write_mb_s"] for x in d["runs"]])
    row("  the repeat's first write", d["first_write_mb_s"], "MB/s", [x["first_write_mb_s"] for x in d["runs"]])
    row("disk read, cold (evicted)", d["read_cold_mb_s"], "MB/s", [x["read_cold_mb_s"] for x in d["runs"]])
    row("disk read, page cache", d["read_cached_mb_s"], "MB/s", [x["read_cached_mb_s"] for x in d["runs"]])
    row("checkpoint save (sync)", r["save_mb_s"], "MB/s",
        [m["checkpoint_bytes"] / x["wall_s"] / MB for x in r["runs"]["sync"]])
    row("checkpoint load, cold (evicted)", r["load_mb_s"], "MB/s",
        [m["checkpoint_bytes"] / x["s"] / MB for x in r["runs"]["load_cold"]])
    row("checkpoint load, page cache", r["load_cached_mb_s"], "MB/s",
        [m["checkpoint_bytes"] / x["s"] / MB for x in r["runs"]["load_cached"]])
    row("SHA-256 of the saved files", m["checkpoint_bytes"] / r["checksum_s"] / MB, "MB/s",
        [m["checkpoint_bytes"] / x["checksum_s"] / MB for x in r["runs"]["sync"]])
    print(f"{'checksums / sync save time':34s}{r['checksum_s'] / r['save_s']:9.3f}        "
          f"(part of the save: rank 0 hashes every file before sealing the checkpoint)")
    print(f"{'save / disk write':34s}{r['save_mb_s'] / d['write_mb_s']:9.2f}        "
          f"load cold / disk read cold {r['load_mb_s'] / d['read_cold_mb_s']:.2f}")
    ms = lambda x: f"{x * 1e3:9.1f} ms   "
    print(f"{'step blocked by a sync save':34s}{ms(b['sync_blocking_s'])}"
          + " ".join(f"{x['wall_s'] * 1e3:.1f}" for x in r["runs"]["sync"]))
    print(f"{'step blocked by an async save':34s}{ms(b['async_blocking_s'])}"
          + " ".join(f"{x['manager_blocking_s'] * 1e3:.1f}" for x in r["runs"]["async"]))
    if b["async_finalize_in_poll_s"] is not None:
        print(f"{'  + its finalize in a later poll()':34s}{ms(b['async_finalize_in_poll_s'])}"
              + " ".join(f"{x['finalize_in_poll_s'] * 1e3:.1f}" for x in r["runs"]["async"]
                         if x["finalize_in_poll_s"] is not None))
    print(f"{'async save until finalized':34s}{ms(b['async_total_s'])}"
          + " ".join(f"{x['wall_s'] * 1e3:.1f}" for x in r["runs"]["async"]))
    ratio = b["ratio_async_over_sync"]
    how = "" if not ratio > 0 else (f"(an async save blocks {1 / ratio:.1f}x less than a sync one)" if ratio <= 1
                                    else f"(an async save blocks {ratio:.1f}x LONGER than a sync one)")
    print(f"{'blocking async / sync':34s}{ratio:9.3f}        {how}")
    print(f"(MB = 10^6 bytes. Disk: a {mib:.1f} MiB file written in {CHUNK >> 20} MiB chunks + fsync, twice per "
          f"repeat: the second write is the figure (fsync {d['fsync_s'] * 1e3:.0f} ms of its "
          f"{d['write_s'] * 1e3:.0f} ms), the first is shown apart. The read-back right after the write comes from "
          f"the page cache; the cold read follows fsync + posix_fadvise(DONTNEED), {ev_txt}. Cold loads evict "
          f"the checkpoint's files the same way first"
          + (f" (residency then {max(lr) * 100:.0f}%)" if lr else "") + ".)")
    w = r["warm_up"]
    if not w["load_restores_weights"]:
        print("WARNING: loading the checkpoint did not restore the saved weights")
    if not w["async_holds_state_at_save"]:
        print("WARNING: the async checkpoint does not hold the weights of the moment save() was called "
              "(they were changed in place right after save() returned)")
    if a.out:
        r["config"] = {"model": a.model, "quick": a.quick, "repeats": a.repeats, "threads": a.threads, "dir": a.dir,
                       "extra_overrides": a.set, "run_overrides": RUN_OVERRIDES}
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(r, fh, indent=2)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
