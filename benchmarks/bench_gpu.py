#!/usr/bin/env python
"""One short, prepared GPU run: tokens/s and MFU of ~0.5B and ~1B Llama-style presets in bf16 under FSDP2
(without and with torch.compile) and DeepSpeed ZeRO-3, on every local GPU (CUDA / NCCL).

    python benchmarks/bench_gpu.py --dry-run            # print the plan and the exact commands; runs nothing
    python benchmarks/bench_gpu.py                      # all 6 rows on every local GPU (a few minutes)
    python benchmarks/bench_gpu.py --sizes 1b --rows fsdp,zero3 --steps 5 --out /tmp/gpu.json

See benchmarks/README.md for what each figure means and how it is measured.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

# Shapes on top of model=llama_100m (no new preset files).
SIZES = {
    "0.5b": dict(hidden_size=1536, num_layers=20, num_heads=24, num_kv_heads=8, intermediate_size=4096),
    "1b": dict(hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4, intermediate_size=5632),
}
ROWS = {"fsdp": ("fsdp", ["train.compile=false"]), "fsdp_compile": ("fsdp", ["train.compile=true"]),
        "zero3": ("zero3", [])}


def size_overrides(size: str, seq_len: int) -> list:
    return ["model=llama_100m", *(f"model.{k}={v}" for k, v in SIZES[size].items()),
            f"model.max_position_embeddings={max(2048, seq_len)}"]


def model_counts(size: str, seq_len: int) -> dict:
    """Parameters of the shape and FLOPs per token."""
    return C.model_counts(size_overrides(size, seq_len), seq_len)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.5b,1b", help=f"comma list of {', '.join(SIZES)} (default both)")
    ap.add_argument("--rows", default="fsdp,fsdp_compile,zero3", help=f"comma list of {', '.join(ROWS)}")
    ap.add_argument("--nproc", type=int, help="GPUs = processes (default: every visible GPU)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="steps not measured (compile runs here; default 3)")
    ap.add_argument("--steps", type=int, default=7, help="measured steps (default 7)")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak per GPU if not in trainer/observe/metrics.py")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra Hydra override")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per run (default 420)")
    ap.add_argument("--out", help="write every figure as JSON here")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    a = ap.parse_args(argv)
    sizes, rows = a.sizes.split(","), a.rows.split(",")
    bad = [s for s in sizes if s not in SIZES] + [r for r in rows if r not in ROWS]
    if bad:
        ap.error(f"unknown size/row {bad}")
    import torch

    from trainer.launch.choose import launcher_command, launcher_for

    gpus = torch.cuda.device_count()
    nproc = a.nproc or gpus or 1
    name = torch.cuda.get_device_name(0) if gpus else "no CUDA device"
    peak = a.peak_tflops or C.known_peak_tflops()
    counts = {s: model_counts(s, a.seq_len) for s in sizes}
    print(f"device: {name} x {nproc} | dense bf16 peak {peak or '?'} TFLOP/s per GPU | seq_len {a.seq_len}, "
          f"micro-batch {a.micro_batch}, {a.warmup} warm-up + {a.steps} measured steps")
    for s, c in counts.items():
        print(f"  {s}: {c['params'] / 1e9:.2f}B params, {c['layers']} layers x {c['hidden']}, "
              f"{c['flops_per_token'] / 1e9:.2f} GFLOP per token (6N + 12·L·d·T)")
    plan = []
    for size in sizes:
        for row in rows:
            strategy, extra = ROWS[row]
            overrides = [*size_overrides(size, a.seq_len), f"strategy={strategy}", "precision=bf16",
                         f"data.seq_len={a.seq_len}", f"train.micro_batch_size={a.micro_batch}",
                         f"train.global_batch_size={a.micro_batch * nproc}", f"train.max_steps={a.warmup + a.steps}",
                         *C.QUIET, *extra, *([f"logging.peak_tflops={peak}"] if peak else []), *a.set]
            plan.append((size, row, overrides))
    if a.dry_run:
        print("\ncommands (--dry-run: nothing is run):")
        for size, row, overrides in plan:
            launcher = launcher_for(overrides)
            cmd = launcher_command("torchrun-quiet" if launcher == "torchrun" else launcher, nproc)
            print(f"# {size} {row}\n" + " ".join([*cmd, *overrides, f"hydra.run.dir=<work folder>/{size}-{row}"]))
        return 0
    if not gpus:
        C.fail("bench_gpu", f"no CUDA device visible (torch {torch.__version__}, CUDA build "
                            f"{torch.version.cuda or 'none'}): this script needs a GPU machine")
    work, results = tempfile.mkdtemp(prefix="tessera-gpu-"), []
    for size, row, overrides in plan:
        t0 = time.time()
        result = {"size": size, "row": row}
        try:
            run = C.run_trainer(overrides, nproc, os.path.join(work, f"{size}-{row}"), C.thread_env(8), a.timeout)
            measured = [r for r in run["metrics"] if r["step"] > a.warmup]
            tok_s = C.tokens_per_s(run["metrics"], a.warmup)
            # all positions / s over the measured steps, weighted by step time, as the trainer's MFU counts them
            seconds = [1 / r["tokens_per_s"] for r in measured]
            seq_tok_s = sum(r["seq_tokens_per_s"] * s for r, s in zip(measured, seconds)) / sum(seconds)
            mfu = [r["mfu"] for r in measured if "mfu" in r]
            result.update(tokens_per_s=tok_s, seq_tokens_per_s=seq_tok_s,
                          logged_mfu=sum(mfu) / len(mfu) if mfu else None,
                          mfu_recomputed=seq_tok_s * counts[size]["flops_per_token"] / (peak * 1e12 * nproc)
                          if peak else None, peak_mem_gib=max(r.get("peak_mem_gib", 0) for r in run["metrics"]))
        except (C.RunFailed, AssertionError) as e:
            result["error"] = str(e)[-600:]
        result["wall_s"] = time.time() - t0
        results.append(result)
        print(f"[{size} {row}] " + (result.get("error") or f"{result['seq_tokens_per_s']:.0f} tok/s, MFU "
                                                           f"{_pct(result['logged_mfu'])}"), flush=True)
    print("\n" + C.markdown_table(
        ["size", "row", "tokens/s (all GPUs)", "per GPU", "MFU (trainer)", "MFU (recomputed)", "peak mem GiB", "s"],
        [[r["size"], r["row"], *([f"failed: {r['error'][-200:]}", "", "", "", ""] if "error" in r else
          [f"{r['seq_tokens_per_s']:.0f}", f"{r['seq_tokens_per_s'] / nproc:.0f}", _pct(r["logged_mfu"]),
           _pct(r["mfu_recomputed"]), f"{r['peak_mem_gib']:.1f}"]), f"{r['wall_s']:.0f}"] for r in results]))
    C.write_json(a.out, {"device": name, "nproc": nproc, "peak_tflops": peak, "counts": counts, "rows": results})
    return 0 if all("error" not in r for r in results) else 1


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if x is not None else "—"


if __name__ == "__main__":
    sys.exit(main())
