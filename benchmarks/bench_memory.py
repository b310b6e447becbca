#!/usr/bin/env python
"""Per-rank memory of parameters, gradients and optimizer state under ZeRO-1/2/3 (and DDP), measured by the
trainer, next to the ZeRO paper's formulas and DeepSpeed's own estimator.

    python benchmarks/bench_memory.py                                # llama_100m; zero1/2/3 + ddp; world sizes 2, 4
    python benchmarks/bench_memory.py --strategies zero3 --world-sizes 2 --out /tmp/mem.json
    python benchmarks/bench_memory.py --strategies zero2,zero3 --set strategy.reduce_bucket_size=5e6
    python benchmarks/bench_memory.py --quick                        # small model, world size 2, zero2 + zero3

Each (strategy, world size N) is one real training run, `deepspeed --num_gpus N trainer/main.py strategy=...
precision=bf16 train.max_steps=1` (seq_len 32, global batch N, micro batch 1; eval, export, checkpoints off).
The trainer measures its own model states from the live tensors (trainer/memory.py) at three points of the first
step (end of backward, inside the optimizer step, after it) and rank 0 writes `<run dir>/memory.json` with every
rank's figures. The table shows, per rank (the largest rank), the peak of each category over those points:

* params, grads, optim+master (AdamW moments + step scalars + fp32 master copies), and "model states" = their
  sum, the quantity the paper's formulas describe;
* "formula": the ZeRO paper (Rajbhandari et al., 2020, sec. 5) with mixed-precision Adam, K = 12: bf16 params
  2Ψ + bf16 grads 2Ψ + fp32 master / momentum / variance 12Ψ = 16Ψ, of which ZeRO-1 shards the 12Ψ
  (4Ψ + 12Ψ/N), ZeRO-2 also the grads (2Ψ + 14Ψ/N), ZeRO-3 everything (16Ψ/N); DDP: 16Ψ (Tessera's ddp runs
  bf16 as autocast over fp32 weights, so its 16Ψ is 4Ψ params + 4Ψ grads + 8Ψ moments, with no master copy);
* "DS estimate": DeepSpeed's estimator for the same setup, without offload (the per-GPU figure that
  `estimate_zero2_model_states_mem_needs_all_cold` / `estimate_zero3_model_states_mem_needs_all_cold` print;
  zero2's for ZeRO-1, which has none of its own): 2Ψ + 18Ψ/N and 4·largest_layer + 18Ψ/N. Its 18 counts the
  bf16 and the fp32 copy of the gradient partition (2 + 4) on top of the paper's 12;
* "buffers": ZeRO's gradient-reduction buckets as allocated (`reduce_bucket_size` elements each; the part
  gradients occupy is in "grads"). These are not model states, and no formula counts them.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
MIB = 2**20

DEFAULTS = dict(model="llama_100m", world_sizes="2,4", strategies="zero1,zero2,zero3,ddp")
QUICK = dict(model="tiny", world_sizes="2", strategies="zero2,zero3")
# --quick shrinks the preset to a debug size: the smoke test runs in seconds of compute.
QUICK_MODEL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
               "model.intermediate_size=128", "data.embedded_documents=400"]


# ---------------------------------------------------------------------------------------------------------------
# Reference figures
# ---------------------------------------------------------------------------------------------------------------
def paper_formula(strategy: str, psi: int, n: int) -> dict:
    """Bytes per rank from the ZeRO paper (mixed-precision Adam, K = 12), split into its parts."""
    if strategy == "ddp":
        # The paper's data-parallel baseline is 2Ψ + 2Ψ + 12Ψ; Tessera's ddp in bf16 holds fp32 weights and grads
        # (autocast) and two fp32 moments: 4Ψ + 4Ψ + 8Ψ. Same 16Ψ.
        parts = {"params": 4 * psi, "grads": 4 * psi, "optim_master": 8 * psi}
        text = "16Ψ"
    elif strategy == "zero1":
        parts = {"params": 2 * psi, "grads": 2 * psi, "optim_master": 12 * psi / n}
        text = "4Ψ+12Ψ/N"
    elif strategy == "zero2":
        parts = {"params": 2 * psi, "grads": 2 * psi / n, "optim_master": 12 * psi / n}
        text = "2Ψ+14Ψ/N"
    elif strategy in ("zero3", "zero3_offload"):
        parts = {"params": 2 * psi / n, "grads": 2 * psi / n, "optim_master": 12 * psi / n}
        text = "16Ψ/N"
    else:
        raise ValueError(strategy)
    return {"total": sum(parts.values()), "parts": parts, "text": text}


def deepspeed_estimate(strategy: str, psi: int, largest_layer: int, n: int):
    """DeepSpeed's per-GPU estimate without offload (the figure its *_all_cold function prints for
    offload_optimizer=none [, offload_param=none, zero_init=1]), and that printout; (None, "") for ddp."""
    if strategy == "ddp":
        return None, ""
    out = io.StringIO()
    if strategy in ("zero1", "zero2"):
        from deepspeed.runtime.zero import stage_1_and_2 as zero2

        with contextlib.redirect_stdout(out):
            zero2.estimate_zero2_model_states_mem_needs_all_cold(psi, num_gpus_per_node=n, num_nodes=1)
        _, gpu = zero2.estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=n, num_nodes=1, cpu_offload=False)
    else:
        from deepspeed.runtime.zero import stage3 as zero3

        with contextlib.redirect_stdout(out):
            zero3.estimate_zero3_model_states_mem_needs_all_cold(psi, largest_layer, num_gpus_per_node=n, num_nodes=1)
        _, gpu, _ = zero3.estimate_zero3_model_states_mem_needs(psi, largest_layer, num_gpus_per_node=n, num_nodes=1,
                                                                cpu_offload=False, cpu_offload_params=False,
                                                                zero_init=True)
    return int(gpu), out.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_overrides(a, strategy: str, n: int) -> list:
    return [
        f"model={a.model}", *(QUICK_MODEL if a.quick else []), f"strategy={strategy}", "precision=bf16",
        f"data.seq_len={a.seq_len}", "train.max_steps=1", f"train.global_batch_size={n}", "train.micro_batch_size=1",
        "train.log_every=1", "eval.every=0", "eval.at_start=false", "eval.at_end=false", "export.hf_at_end=false",
        "checkpoint.every=0", "checkpoint.at_end=false", "checkpoint.resume=none", "logging.progress=false",
        "logging.tensorboard=false", *a.set,
    ]


def measure(a, strategy: str, n: int, work: str) -> dict:
    run_dir = os.path.join(work, f"{strategy}-ws{n}")
    log_path = run_dir + ".log"
    deepspeed = os.path.join(VENV_BIN, "deepspeed")
    if not os.path.exists(deepspeed):
        deepspeed = shutil.which("deepspeed") or "deepspeed"
    cmd = [deepspeed, "--num_gpus", str(n), "--master_port", str(free_port()), os.path.join(ROOT, "trainer", "main.py"),
           *run_overrides(a, strategy, n), f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(a.threads))
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout)
    seconds = time.perf_counter() - t0
    with open(log_path) as fh:
        text = fh.read()
    if proc.returncode != 0 or not os.path.exists(os.path.join(run_dir, "memory.json")):
        raise SystemExit(f"bench_memory: {strategy} at world size {n} failed (exit {proc.returncode}); the end of "
                         f"{log_path}:\n{text[-3000:]}")
    if a.verbose:
        print("\n".join(line for line in text.splitlines() if "model-state memory" in line))
    with open(os.path.join(run_dir, "memory.json")) as fh:
        return dict(json.load(fh), seconds=seconds)


def summarize(strategy: str, n: int, mem: dict) -> dict:
    """One table row: the largest rank's peaks, the formula, DeepSpeed's estimate and the ratios."""
    psi, ranks = mem["num_params"], mem["ranks"]

    def top(key):
        return max(r[key] for r in ranks)

    formula = paper_formula(strategy, psi, n)
    estimate, printout = deepspeed_estimate(strategy, psi, mem["largest_layer_params"], n)
    row = {
        "strategy": strategy, "world_size": n, "num_params": psi, "largest_layer_params": mem["largest_layer_params"],
        "params": top("params"), "grads": top("grads"),
        "optim_master": max(r["optimizer"] + r["master_params"] for r in ranks),
        "optimizer": top("optimizer"), "master_params": top("master_params"),
        "model_states": top("model_states"), "buffers": top("buffers"), "other": top("other"),
        "grads_peak_at": sorted({r["peak_point"]["grads"] for r in ranks}),
        "between_steps": max(sum(r["points"]["after_step"][k] for k in ("params", "grads", "optimizer",
                                                                         "master_params")) for r in ranks),
        "formula": formula["total"], "formula_text": formula["text"], "formula_parts": formula["parts"],
        "ratio_formula": top("model_states") / formula["total"],
        "deepspeed_estimate": estimate, "deepspeed_estimator_printout": printout,
        "ratio_estimate": top("model_states") / estimate if estimate else None,
        "seconds": mem.get("seconds"), "memory_json": mem,
    }
    return row


# ---------------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------------
def _m(x) -> str:
    return "—" if x is None else f"{x / MIB:.1f}"


def table(rows) -> str:
    head = ("| strategy | N | params | grads (peak at) | optim+master | model states | between steps | paper formula "
            "| measured/formula | DS estimate | measured/DS | buffers (allocated) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        at = "/".join(p.replace("backward_end", "bwd end").replace("optimizer_step", "in step")
                      .replace("after_step", "after") for p in r["grads_peak_at"])
        lines.append(
            f"| {r['strategy']} | {r['world_size']} | {_m(r['params'])} | {_m(r['grads'])} ({at}) | "
            f"{_m(r['optim_master'])} | {_m(r['model_states'])} | {_m(r['between_steps'])} | "
            f"{r['formula_text']} = {_m(r['formula'])} | {r['ratio_formula']:.2f} | {_m(r['deepspeed_estimate'])} | "
            f"{'—' if r['ratio_estimate'] is None else format(r['ratio_estimate'], '.2f')} | {_m(r['buffers'])} |")
    return "\n".join(lines)


NOTES = """\
Notes (DeepSpeed's behaviour read in its source, 0.19.8, and seen in these figures; CPU accelerator, bf16, gradient
accumulation dtype = bf16, overlap_comm and contiguous_gradients on, as Tessera configures it):
* Per-rank MiB; each column is the largest rank's peak over three points of the first step (end of backward,
  inside the optimizer step, after it); "model states" = params + grads + optim+master; "between steps" = the
  same four measured after the step (what stays allocated from one step to the next).
* ZeRO-1/2 (DeepSpeedZeroOptimizer): every rank keeps all bf16 parameters in one flat buffer (2Ψ), the fp32
  master copy of its partition (4Ψ/N) and AdamW's two moments of it (8Ψ/N): optim+master = 12Ψ/N as in the paper.
* Gradients in ZeRO-1/2: in backward each bf16 gradient is copied into a reduction bucket of reduce_bucket_size
  elements (two buckets with overlap_comm) and reduced when the bucket is full or backward ends; this rank keeps
  its partition in bf16 (2Ψ/N). ZeRO-1 takes the same path (it only skips freeing the other partitions'
  gradients, which point into the reused buckets), so ZeRO-1 and ZeRO-2 measure the same. With the default
  reduce_bucket_size 5e8 >= Ψ, one bucket holds the whole gradient (2Ψ) at the end of backward, on every rank.
  In the step the partition is also copied to fp32 (4Ψ/N) for the optimizer: 6Ψ/N of gradients, which
  DeepSpeed's estimator counts (its 18Ψ/N = 2 + 4 + 12) and the paper does not. No gradient is left after the
  step, so between steps ZeRO-1/2 hold 2Ψ + 12Ψ/N.
* ZeRO-3 (DeepSpeedZeroOptimizer_Stage3): bf16 parameter partitions (2Ψ/N; parameters under
  stage3_param_persistence_threshold stay whole on every rank), fp32 master partition + moments (12Ψ/N) and a
  bf16 gradient-partition buffer (2Ψ/N) that stays allocated: between steps exactly the paper's 16Ψ/N. On top,
  transiently: the bucket collects the full gradient (2Ψ) in backward when reduce_bucket_size >= Ψ, and the
  step adds the fp32 copy of the gradient partition (4Ψ/N): in-step peak 20Ψ/N. DeepSpeed's estimate is
  18Ψ/N + 4 x the largest layer.
* "buffers" is the reduction buckets' allocation less what gradients occupy (ZeRO-1/2: two buckets, allocated
  in backward and freed at its end; ZeRO-3: one, kept for the whole run): 2 x 5e8 and 5e8 bf16 elements by
  default, more than all model states of a 100M model. On the CPU accelerator torch.empty is backed lazily by
  the OS, so only pages that gradients touched become resident; on a GPU the whole allocation is real. A
  smaller strategy.reduce_bucket_size (--set strategy.reduce_bucket_size=5e6) shrinks both the buffers and the
  full-gradient peak; the in-step fp32 copy remains.
* ddp: fp32 weights under bf16 autocast: params 4Ψ, grads 4Ψ (views into DDP's buckets, which stay allocated in
  its C++ reducer after zero_grad and are not visible from Python after the step), AdamW 8Ψ; no master copy.
  The AdamW `step` counters (4 bytes per parameter tensor) are counted in optim+master."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=f"preset in conf/model (default {DEFAULTS['model']})")
    ap.add_argument("--world-sizes", help=f"comma-separated (default {DEFAULTS['world_sizes']})")
    ap.add_argument("--strategies", help=f"comma-separated, of zero1, zero2, zero3, zero3_offload, ddp (default "
                                         f"{DEFAULTS['strategies']})")
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank (default 1)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra Hydra override for every run, e.g. --set strategy.reduce_bucket_size=5e6")
    ap.add_argument("--quick", action="store_true",
                    help="a debug-size model, world size 2, zero2 + zero3 (the smoke test)")
    ap.add_argument("--out", help="write the rows (and each run's memory.json) as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (run dirs, logs)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    ap.add_argument("--verbose", action="store_true", help="show each run's memory log line")
    a = ap.parse_args(argv)
    base = QUICK if a.quick else DEFAULTS
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.world_size_list = [int(x) for x in str(a.world_sizes).split(",") if x.strip()]
    a.strategy_list = [x.strip() for x in str(a.strategies).split(",") if x.strip()]
    bad = [s for s in a.strategy_list if s not in ("zero1", "zero2", "zero3", "zero3_offload", "ddp")]
    if bad or not a.strategy_list or not a.world_size_list or min(a.world_size_list) < 1:
        ap.error(f"--strategies must name zero1/zero2/zero3/zero3_offload/ddp (got {bad or a.strategies}) and "
                 f"--world-sizes positive integers")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench-memory-")
    rows = []
    try:
        for n in a.world_size_list:
            for strategy in a.strategy_list:
                mem = measure(a, strategy, n, work)
                row = summarize(strategy, n, mem)
                rows.append(row)
                print(f"{strategy} N={n}: model states {_m(row['model_states'])} MiB per rank (formula "
                      f"{_m(row['formula'])}), {row['seconds']:.0f} s", flush=True)
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    psi = rows[0]["num_params"]
    print()
    print(f"Per-rank model-state memory, {a.model}{' (quick size)' if a.quick else ''}: Ψ = {psi:,} parameters "
          f"({psi / 1e6:.1f}M), largest layer {rows[0]['largest_layer_params']:,}; precision bf16, seq_len "
          f"{a.seq_len}, global batch = N, one step{'; ' + ' '.join(a.set) if a.set else ''}. MiB = 2^20 bytes.")
    print("Formula: ZeRO paper, mixed-precision Adam (K=12): bf16 params 2Ψ + bf16 grads 2Ψ + fp32 master, "
          "momentum, variance 12Ψ = 16Ψ.")
    print()
    print(table(rows))
    print()
    print(NOTES)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)) or ".", exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump({"config": {"model": a.model, "quick": a.quick, "world_sizes": a.world_size_list,
                                  "strategies": a.strategy_list, "seq_len": a.seq_len, "threads": a.threads,
                                  "precision": "bf16", "extra_overrides": a.set},
                       "rows": rows}, fh, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
