#!/usr/bin/env python
"""Ring attention against Ulysses at a long sequence: one prepared run per `strategy.cp_impl`, pure context
parallelism over every local GPU (`strategy=fsdp strategy.cp=<GPUs>`), the same model, data, seed and steps: the
per-step losses side by side (and their largest relative difference), tokens/s, the peak device memory and the
activations a rank keeps for backward (memory.json).

    python benchmarks/bench_long_context.py --dry-run --nproc 2     # the plan and the exact commands; runs nothing
    python benchmarks/bench_long_context.py                         # 0.5B, 32k tokens, bf16, every local GPU
    python benchmarks/bench_long_context.py --size 1b --seq-len 65536 --out /tmp/cp.json
    python benchmarks/bench_long_context.py --quick                 # CPU: the debug model, Ulysses only

Ring attention runs on CUDA kernels only (torch has none for CPU): without a GPU the ring row is listed as skipped.
Context parallelism needs at least 2 ranks, and NCCL one GPU per rank. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from bench_gpu import SIZES, size_overrides  # noqa: E402

IMPLS = ("ulysses", "ring")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma list of ulysses, ring (default both)")
    ap.add_argument("--size", default="0.5b", choices=sorted(SIZES), help="Llama shape (bench_gpu.py's; default 0.5b)")
    ap.add_argument("--seq-len", type=int, default=32768, help="tokens per sequence (default 32768)")
    ap.add_argument("--nproc", type=int, help="ranks = context degree (default: every visible GPU)")
    ap.add_argument("--warmup", type=int, default=2, help="steps not measured (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps (default 5)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra Hydra override")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")
    ap.add_argument("--out", help="write every figure as JSON here")
    ap.add_argument("--quick", action="store_true",
                    help="CPU check (on any machine): the debug model, 64 tokens, 2 CPU ranks, 3 steps")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    a = ap.parse_args(argv)
    a.impls = a.impls.split(",")
    if [i for i in a.impls if i not in IMPLS]:
        C.fail("bench_long_context", f"unknown --impls {a.impls}: choose from {', '.join(IMPLS)}")
    if a.quick:
        a.seq_len, a.warmup, a.steps, a.nproc = 64, 1, 2, a.nproc or 2
    return a


def overrides(a, impl: str, nproc: int) -> list:
    """One sequence per step over `nproc` context ranks: bf16 and full activation checkpointing on a GPU shape, fp32
    on the debug model (--quick)."""
    shape = [*C.DEBUG_MODEL, "precision=fp32", "train.device=cpu"] if a.quick else [
        *size_overrides(a.size, a.seq_len), "precision=bf16", "train.activation_checkpointing=full"]
    return [*shape, "strategy=fsdp", f"strategy.cp={nproc}", f"strategy.cp_impl={impl}",
            f"data.seq_len={a.seq_len}", "train.micro_batch_size=1", "train.global_batch_size=1",
            f"train.max_steps={a.warmup + a.steps}", "logging.memory_report=true", *C.QUIET, *a.set]


def measure(a, impl: str, nproc: int, work: str) -> dict:
    run = C.run_trainer(overrides(a, impl, nproc), nproc, os.path.join(work, impl), C.thread_env(1 if a.quick else 8),
                        a.timeout)
    ranks = (run["memory"] or {}).get("ranks", [])
    return {"losses": [r["loss"] for r in run["metrics"]], "tokens_per_s": C.tokens_per_s(run["metrics"], a.warmup),
            "peak_mem_gib": max((r.get("peak_mem_gib", 0) for r in run["metrics"]), default=0),
            "activations_per_rank": max((r.get("activations", 0) for r in ranks), default=0)}


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    from trainer.launch.choose import launcher_command

    gpus = torch.cuda.device_count()
    nproc = a.nproc or gpus
    print(f"device: {torch.cuda.get_device_name(0) if gpus else 'CPU'} | {nproc} context ranks | "
          f"{'debug model' if a.quick else a.size} | seq_len {a.seq_len} | {a.warmup} warm-up + {a.steps} steps")
    if a.dry_run:
        for impl in a.impls:
            print(f"# {impl}\n" + " ".join([*launcher_command("torchrun-quiet", nproc or 2),
                                            *overrides(a, impl, nproc or 2), f"hydra.run.dir=<work folder>/{impl}"]))
        return 0
    if nproc < 2:
        C.fail("bench_long_context", f"context parallelism needs at least 2 ranks ({gpus} GPUs visible; NCCL takes "
                                     f"one GPU per rank): run it on a machine with 2 or more GPUs, or --quick on CPU")
    work, results = tempfile.mkdtemp(prefix="tessera-cp-"), {}
    for impl in a.impls:
        t0 = time.time()
        if impl == "ring" and (a.quick or not gpus):  # --quick runs on CPU ranks, GPUs or not
            results[impl] = {"skipped": "ring attention needs CUDA kernels"}
        else:
            try:
                results[impl] = measure(a, impl, nproc, work)
            except (C.RunFailed, AssertionError) as e:
                results[impl] = {"error": str(e)[-600:]}
        results[impl]["wall_s"] = time.time() - t0
        print(f"[{impl}] {results[impl]}", flush=True)
    report(results)
    C.write_json(a.out, {"device": torch.cuda.get_device_name(0) if gpus else "cpu", "nproc": nproc,
                         "size": "debug" if a.quick else a.size, "seq_len": a.seq_len, "impls": results})
    return 0 if all("error" not in r for r in results.values()) else 1


def report(results: dict) -> None:
    base = results.get("ulysses", {}).get("losses")
    rows = []
    for impl, r in results.items():
        if "losses" not in r:
            rows.append([impl, r.get("skipped") or f"failed: {r['error'][-200:]}", "", "", "", "", ""])
            continue
        diff = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], base)) if base else None
        rows.append([impl, f"{r['tokens_per_s']:.0f}", f"{r['peak_mem_gib']:.2f}",
                     C.mib(r["activations_per_rank"]), " ".join(f"{x:.4f}" for x in r["losses"]),
                     "—" if diff is None else f"{diff:.1e}", f"{r['wall_s']:.0f}"])
    print("\n" + C.markdown_table(["cp_impl", "tokens/s", "peak mem GiB", "activations per rank MiB", "losses",
                                   "max rel. loss diff vs ulysses", "s"], rows))


if __name__ == "__main__":
    sys.exit(main())
