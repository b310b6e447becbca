"""Soak: a long run with frequent checkpoints, watched from outside; host memory, open files and disk must stay flat.

    python benchmarks/bench_soak.py                 # 1,000 steps, DDP on 2 ranks, a checkpoint every 20, keep_last 2
    python benchmarks/bench_soak.py --quick         # 200 steps (what the tests run)
    python benchmarks/bench_soak.py --strategy fsdp --steps 2000 --out soak.json

Five times a second the script reads each rank's resident memory (VmRSS) and open file descriptors from /proc, and
the size of the run directory. Warm-up is the first 20% of the steps (allocator pools, the first saves, lazily
imported modules); growth is the last quarter's median against the median at the end of warm-up, per rank (for
open files too: a file that a save holds open at the moment of a sample is not a leak).
Disk is bounded when the run directory never holds more than keep_last checkpoints (plus one being written).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

LIMIT_PCT = 5.0


def _rank_pids(run_dir: str) -> dict:
    needle = f"hydra.run.dir={run_dir}".encode()
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(pid)
    return found


def _rss_mib(pid: int):
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _open_files(pid: int):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _disk(run_dir: str):
    """(bytes under the run directory, complete + partial checkpoint folders)."""
    total, ckpts = 0, 0
    for root, dirs, files in os.walk(run_dir):
        if os.path.basename(root) == "checkpoints":
            ckpts = sum(1 for d in dirs if d.startswith(("step_", ".tmp-")))
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total, ckpts


def _step(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), "rb") as fh:
            lines = fh.read().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def soak(a) -> dict:
    run_dir = os.path.join(a.workdir, "soak")
    overrides = [*common.DEBUG_MODEL, f"strategy={a.strategy}", f"train.max_steps={a.steps}", "train.log_every=1",
                 "train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=32", "eval.every=0",
                 "eval.at_end=false", "export.hf_at_end=false", "logging.progress=false",
                 f"checkpoint.every={a.every}", f"checkpoint.keep_last={a.keep_last}", *a.set]
    from trainer.launch.choose import launcher_command, launcher_for

    launcher = launcher_for(overrides)
    launcher = "torchrun-quiet" if launcher == "torchrun" else launcher
    cmd = [*launcher_command(launcher, a.nproc), *overrides, f"hydra.run.dir={run_dir}"]
    log = open(os.path.join(a.workdir, "soak.log"), "w")
    proc = subprocess.Popen(cmd, cwd=common.REPO, env=common.thread_env(1), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    samples, t0 = [], time.time()  # (step, {rank: (rss MiB, fds)}, disk bytes, checkpoints)
    try:
        while proc.poll() is None:
            if time.time() - t0 > a.timeout:
                raise common.RunFailed(f"no end after {a.timeout:.0f} s")
            ranks = {r: (_rss_mib(p), _open_files(p)) for r, p in _rank_pids(run_dir).items()}
            ranks = {r: v for r, v in ranks.items() if None not in v}
            if ranks:
                samples.append((_step(run_dir), ranks, *_disk(run_dir)))
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    if proc.returncode != 0:
        tail = open(os.path.join(a.workdir, "soak.log")).read().strip().splitlines()[-6:]
        raise common.RunFailed(f"exit {proc.returncode}: " + " | ".join(tail))
    warm = int(a.steps * 0.2)
    rows, result = [], {"steps": a.steps, "every": a.every, "keep_last": a.keep_last, "nproc": a.nproc,
                        "strategy": a.strategy, "seconds": round(time.time() - t0, 1), "ranks": {}}
    for rank in range(a.nproc):
        series = [(s, r[rank]) for s, r, _, _ in samples if rank in r]
        at_warm = [v for s, v in series if warm - a.steps * 0.05 <= s <= warm] or [v for s, v in series if s <= warm]
        late = [v for s, v in series if s >= a.steps * 0.75]
        if not at_warm or not late:
            raise common.RunFailed(f"rank {rank}: too few samples ({len(series)}); run more steps")
        rss0, rss1 = statistics.median(v[0] for v in at_warm), statistics.median(v[0] for v in late)
        # medians: a file a save has open at the moment of a sample is not a leak
        fd0, fd1 = statistics.median(v[1] for v in at_warm), statistics.median(v[1] for v in late)
        growth = 100.0 * (rss1 - rss0) / rss0
        result["ranks"][rank] = {"rss_mib_warm": round(rss0, 1), "rss_mib_late": round(rss1, 1),
                                 "rss_growth_pct": round(growth, 2), "fds_warm": fd0, "fds_late": fd1,
                                 "samples": len(series)}
        rows.append([rank, f"{rss0:.1f}", f"{rss1:.1f}", f"{growth:+.2f}%", fd0, fd1])
    result["disk_max_mib"] = round(max(s[2] for s in samples) / 2**20, 2)
    result["checkpoints_max"] = max(s[3] for s in samples)
    result["disk_end_mib"] = round(_disk(run_dir)[0] / 2**20, 2)
    result["flat"] = all(r["rss_growth_pct"] < LIMIT_PCT and r["fds_late"] <= r["fds_warm"]
                         for r in result["ranks"].values()) and result["checkpoints_max"] <= a.keep_last + 1
    print(f"soak: {a.steps} steps of {a.strategy} on {a.nproc} ranks, a checkpoint every {a.every}, keep_last "
          f"{a.keep_last}, {result['seconds']:.0f} s")
    print(common.markdown_table(["rank", "RSS MiB after warm-up", "RSS MiB last quarter", "growth",
                                 "open files after warm-up", "open files last quarter"], rows))
    print(f"run directory: at most {result['checkpoints_max']} checkpoint folders, {result['disk_max_mib']} MiB "
          f"(end {result['disk_end_mib']} MiB); flat: {result['flat']}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 steps (what the tests run)")
    ap.add_argument("--steps", type=int, help="optimizer steps (default 1000; --quick 200)")
    ap.add_argument("--every", type=int, default=20, help="steps between checkpoints (default 20)")
    ap.add_argument("--keep-last", type=int, default=2, help="checkpoints kept (default 2)")
    ap.add_argument("--strategy", default="ddp", help="default ddp")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra Hydra override")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds (default 3600)")
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args()
    a.steps = a.steps or (200 if a.quick else 1000)
    if a.steps < 50 or a.every < 1 or a.keep_last < 1 or a.nproc < 1:
        ap.error("--steps >= 50, --every >= 1, --keep-last >= 1, --nproc >= 1")
    with tempfile.TemporaryDirectory(prefix="tessera-soak-") as workdir:
        a.workdir = workdir
        try:
            result = soak(a)
        except common.RunFailed as e:
            common.fail("bench_soak.py", str(e))
    common.write_json(a.out, result)


if __name__ == "__main__":
    main()
