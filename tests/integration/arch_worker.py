"""Train several tiny architectures one after another inside ONE launch (one process-group start per layout).

    python  tests/integration/arch_worker.py --layout single --models M --out O --jobs llama,qwen2,llama:sgd
    torchrun --nproc_per_node 2 tests/integration/arch_worker.py --layout ddp --models M --out O --jobs ...

A job is `<arch>` (fp32, AdamW) or `<arch>:<variant>` (`bf16`, `sgd`). Each job runs what trainer/main.py
runs (compose, prepare, build, fit, export_final, close) on the model folder `<models>/<arch>` (see
tests/archs.py), into the run directory `<out>/<job>` (`:` becomes `-`). A failing job is recorded (exception
type and first line) and the next job starts on a fresh process group: one broken architecture never stops
the others.

- Process groups: `close` destroys the group as in a real run; the next job initializes a new one that
  rendezvouses under a key of its own in the launcher's TCP store (torchrun's agent store), so it never reads
  the addresses of the group before it. DeepSpeed's module-level group caches are cleared between jobs.
- Failures: a failing rank aborts and frees its groups (a peer waiting on it in a collective then fails at
  once, or at the latest after train.collective_timeout_s=COLLECTIVE_TIMEOUT_S). Between jobs the ranks agree
  through the store (never a collective) that all of them are done; a rank still stuck after `--wait-s` ends
  the worker (exit 3), and the caller relaunches it for the jobs left.
- Results: every rank writes `<out>/results/<job>.rank<r>.json` (ok, phase, error, traceback, seconds per
  phase); `collect` merges them (also after a worker died), rank 0 writes `<out>/summary.json` and a table.
- ARCH_WORKER_FAIL=<job>@<rank>[:crash] makes that rank fail (or die) after its first step: the harness' own
  check that a one-sided failure neither hangs the launch nor stops the jobs after it.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Launchers and strategies per layout (world size 2 except `single`).
LAYOUTS = {
    "single": ("python", ["strategy=single"]),
    "ddp": ("torchrun", ["strategy=ddp"]),
    "zero2": ("torchrun", ["strategy=zero2"]),
    "zero3": ("torchrun", ["strategy=zero3"]),
    "fsdp": ("torchrun", ["strategy=fsdp"]),
    "tp": ("torchrun", ["strategy=tp"]),
    "pp": ("torchrun", ["strategy=pp"]),
    "cp": ("torchrun", ["strategy=fsdp", "strategy.cp=2"]),  # context parallelism (Ulysses) alone
    "ep": ("torchrun", ["strategy=fsdp", "strategy.ep=2"]),  # the experts split over both ranks, FSDP for the rest
}
# bf16 also exports in bf16 (export.dtype): the fp32 masters cast, on every layout.
VARIANTS = {"fp32": [], "bf16": ["precision=bf16", "export.dtype=bf16"], "fp16": ["precision=fp16"],
            "sgd": ["optim=sgd"], "adafactor": ["optim=adafactor"], "muon": ["optim=muon"],
            "adamw_8bit": ["optim=adamw_8bit"]}
STEPS = 3
EVAL_SEQUENCES = 8
COLLECTIVE_TIMEOUT_S = 30  # a rank left waiting by a failed peer gives up after this


def job_overrides(job: str, layout: str, models_dir) -> list:
    arch, variant = split_job(job)
    return (["model=hf", f"model.name_or_path={Path(models_dir) / arch}", "data=default",
             "data.embedded_documents=60", "data.seq_len=32", f"train.max_steps={STEPS}", "train.log_every=1",
             "train.global_batch_size=8", "train.micro_batch_size=2", "scheduler.warmup_steps=1", "eval.every=0",
             "eval.at_end=true", f"eval.max_sequences={EVAL_SEQUENCES}", "export.hf_at_end=true",
             "checkpoint.every=0", "checkpoint.at_end=false", "logging.progress=false",
             f"train.collective_timeout_s={COLLECTIVE_TIMEOUT_S}"]
            + LAYOUTS[layout][1] + VARIANTS[variant])


def split_job(job: str):
    arch, _, variant = job.partition(":")
    return arch, variant or "fp32"


def job_dir_name(job: str) -> str:
    return job.replace(":", "-")


def first_line(e: BaseException) -> str:
    from tessera.errors import ConfigError

    if isinstance(e, ConfigError) and e.problems:
        text = str(e.problems[0])
    else:
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        text = lines[0] if lines else ""
    return f"{type(e).__name__}: {text}"[:400]


def _result_path(out: Path, job: str, rank: int) -> Path:
    return out / "results" / f"{job_dir_name(job)}.rank{rank}.json"


def _inject_failure(run, crash: bool) -> None:
    """ARCH_WORKER_FAIL=<job>@<rank>[:crash]: that rank raises (or with `:crash` dies) after its first
    optimizer step, leaving its peers in the next step's collectives: the harness' own check that a one-sided
    failure neither hangs the launch nor stops the jobs after it."""
    step = run.strategy.optimizer_step

    def failing(*args, **kwargs):
        step(*args, **kwargs)
        if crash:
            os._exit(9)
        raise RuntimeError("injected failure (ARCH_WORKER_FAIL)")

    run.strategy.optimizer_step = failing


def _abort_process_groups() -> None:
    """Abort every process group of this rank (their connections close), as this process' death would."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - best effort; the peers then wait for the collective timeout
            pass


def _forget_process_groups() -> None:
    """A fresh process group per job (as a fresh launch would have): destroy ours, and drop the groups
    DeepSpeed caches at module level (they belong to the destroyed world)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                     "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP", "mesh_device", "mpu"):
            if hasattr(groups, name):
                setattr(groups, name, None)
        for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                     "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
            value = getattr(groups, name, None)
            if isinstance(value, dict):
                value.clear()


def _dump_val_batch(run, path: Path) -> None:
    """The validation sequences the trainer's final evaluation used (for the export check in the tests)."""
    import numpy as np

    val = run.data.val
    n = min(len(val), run.cfg.eval.max_sequences) if run.cfg.eval.max_sequences else len(val)
    idx = np.arange(n)
    batch = val.get(idx)
    path.write_text(json.dumps({"input_ids": batch["input_ids"].tolist(), "labels": batch["labels"].tolist(),
                                "targets": int(val.count_targets(idx))}))


def _init_process_group(store, key: str, rank: int, world: int) -> None:
    """The default process group for one job, rendezvousing under a key of its own in the launcher's store
    (`build` then finds it initialized): a re-initialized group must never read the addresses its predecessor
    left in the store."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, store=dist.PrefixStore(key, store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def run_job(job: str, layout: str, models_dir, out: Path, rank: int, store=None, world: int = 1) -> dict:
    """One training run as trainer/main.py does it, in this process; never raises."""
    from tests.conftest import compose_config
    from trainer.run import build as B
    from trainer.run.loop import export_final, fit

    run_dir = out / job_dir_name(job)
    arch, variant = split_job(job)
    record = {"job": job, "arch": arch, "variant": variant, "layout": layout, "rank": rank, "ok": False,
              "phase": "compose", "error": None, "run_dir": str(run_dir)}
    t0 = time.perf_counter()
    times = record["phase_seconds"] = {}

    def phase(name):  # the phase now starting; the time of the one that ended
        times[record["phase"]] = round(time.perf_counter() - t0 - sum(times.values()), 2)
        record["phase"] = name

    run, finished = None, False
    try:
        cfg = compose_config(job_overrides(job, layout, models_dir))
        phase("prepare")
        prepared = B.prepare(cfg, str(run_dir))
        phase("build")
        if store is not None and prepared.strategy_cls.capabilities.needs_process_group:
            _init_process_group(store, f"pg/{job}", rank, world)
        try:
            run = B.build(prepared)
            inject = os.environ.get("ARCH_WORKER_FAIL", "")
            if inject.split(":")[0] == f"{job}@{rank}":
                _inject_failure(run, crash=inject.endswith(":crash"))
            phase("fit")
            fit(run)
            phase("export")
            export_final(run)
            if rank == 0:
                _dump_val_batch(run, run_dir / "val_batch.json")
            finished = True
        except BaseException:
            record["failed_at"] = time.time()  # before the peers notice (the earliest failure is the cause)
            _abort_process_groups()  # peers waiting on this rank in a collective fail now, not at the timeout
            raise
        finally:
            if finished:
                phase("close")
            B.close(run, graceful=finished)
        phase("done")
        record["ok"] = True
    except BaseException as e:  # noqa: BLE001 - record everything; the next architecture still runs
        if isinstance(e, KeyboardInterrupt):
            raise
        record["error"] = first_line(e)
        record.setdefault("failed_at", time.time())
        record["traceback"] = traceback.format_exc()[-4000:]
        print(f"[rank {rank}] {job} failed in {record['phase']}: {record['error']}", file=sys.stderr, flush=True)
    finally:
        # Free what holds the groups (a pipeline schedule, DTensors, hooks in reference cycles): a group's
        # connections close only when it is freed, and a peer still waiting on them then fails at once.
        run = prepared = None
        gc.collect()
        _forget_process_groups()
    record["seconds"] = round(time.perf_counter() - t0, 2)
    return record


def _store(world: int):
    """A client of the launcher's TCP store (torchrun's agent store): it outlives our process groups."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return dist.PrefixStore(f"arch_worker/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}", store)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", required=True, choices=sorted(LAYOUTS))
    ap.add_argument("--models", required=True, help="folder with one model folder per architecture")
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", required=True, help="comma-separated <arch>[:<variant>]")
    ap.add_argument("--wait-s", type=float, default=COLLECTIVE_TIMEOUT_S + 60,
                    help="how long a finished rank waits for the others before giving up on the group")
    args = ap.parse_args(argv)
    out = Path(args.out)
    (out / "results").mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    store = _store(world) if world > 1 else None
    jobs = [j for j in args.jobs.split(",") if j]
    t_start = time.perf_counter()
    for i, job in enumerate(jobs):
        record = run_job(job, args.layout, args.models, out, rank, store, world)
        _result_path(out, job, rank).write_text(json.dumps(record, indent=1))
        if store is not None:
            store.set(f"{job}/{rank}", "ok" if record["ok"] else "failed")
            try:
                store.wait([f"{job}/{r}" for r in range(world)], datetime.timedelta(seconds=args.wait_s))
            except Exception:  # noqa: BLE001 - a peer is stuck or gone: this group can't run more jobs
                print(f"[rank {rank}] {job}: the other ranks did not finish within {args.wait_s:.0f}s; giving up "
                      f"(jobs left: {jobs[i + 1:]})", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(3)
    if rank == 0:
        summary = {"layout": args.layout, "world_size": world, "seconds": round(time.perf_counter() - t_start, 2),
                   "jobs": collect(out, jobs, world)}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        width = max(len(j) for j in jobs)
        for job, r in summary["jobs"].items():
            print(f"{args.layout:6s} {job:{width}s} {'ok  ' if r['ok'] else 'FAIL'} {r['seconds']:6.1f}s "
                  f"{r['error'] or ''}", flush=True)
        print(f"{args.layout}: {len(jobs)} jobs in {summary['seconds']:.1f}s", flush=True)
    return 0


def collect(out, jobs, world: int) -> dict:
    """{job: merged record} from the per-rank result files; a job missing a rank's file did not finish there
    (ok=False, error None: the caller knows why). The error shown is the earliest rank's (the root cause; the
    others usually fail because a peer left)."""
    out = Path(out)
    merged = {}
    for job in jobs:
        recs = []
        for r in range(world):
            path = _result_path(out, job, r)
            if path.is_file():
                recs.append(json.loads(path.read_text()))
        failed = sorted((x for x in recs if not x["ok"]), key=lambda x: x.get("failed_at", 0))
        merged[job] = {
            "job": job, "arch": split_job(job)[0], "variant": split_job(job)[1],
            "ok": len(recs) == world and not failed,
            "complete": len(recs) == world,
            "error": failed[0]["error"] if failed else None,
            "phase": failed[0]["phase"] if failed else ("done" if recs else None),
            "failed_ranks": [x["rank"] for x in failed],
            "traceback": failed[0].get("traceback") if failed else None,
            "seconds": max((x["seconds"] for x in recs), default=0.0),
            "run_dir": str(out / job_dir_name(job)),
        }
    return merged


if __name__ == "__main__":
    from tessera import import_time

    with import_time.imports_frozen():  # as trainer/main.py (tessera/import_time.py)
        from trainer.run import build as _build  # noqa: F401 - torch, transformers, the strategies
        from trainer.run import loop as _loop  # noqa: F401
    sys.exit(main())
