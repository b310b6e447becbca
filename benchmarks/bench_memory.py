#!/usr/bin/env python
"""Per-rank memory of parameters, gradients and optimizer state under ZeRO-1/2/3, DDP and FSDP2 (fsdp, hsdp),
measured by the trainer, next to the ZeRO paper's formulas and DeepSpeed's own estimator.

    python benchmarks/bench_memory.py          # llama_100m; zero1/2/3, ddp, fsdp (both reshard modes), hsdp; N = 2, 4
    python benchmarks/bench_memory.py --strategies zero3,fsdp --world-sizes 2 --out /tmp/mem.json
    python benchmarks/bench_memory.py --strategies zero2,zero3 --set strategy.reduce_bucket_size=5e6
    python benchmarks/bench_memory.py --quick                        # small model, world size 2, zero2 + zero3 + fsdp

Each (strategy, world size N) is one real training run, `deepspeed --num_gpus N trainer/main.py strategy=...
precision=bf16 train.max_steps=1` for ZeRO, `torchrun --nproc_per_node N ...` for ddp / fsdp / hsdp (seq_len 32,
global batch N, micro batch 1; eval, export, checkpoints off). Strategy names: zero1, zero2, zero3, zero3_offload,
ddp, fsdp (FSDP2, `strategy.reshard_after_forward=true`), fsdp_noreshard (the same with `false`), hsdp
(replicate x shard with shard groups of `--hsdp-shard` ranks, default 2: 2 x 2 at N = 4; skipped where N / shard
< 2, which would be fsdp). The trainer measures its own model states from the live tensors (trainer/memory.py) at
several points of the first step (end of backward, inside the optimizer step, after it; FSDP also at every
module's forward and backward) and rank 0 writes `<run dir>/memory.json` with every rank's figures. The table
shows, per rank (the largest rank), the peak of each category over those points:

* params, grads, optim+master (AdamW moments + step scalars + fp32 master copies), and "model states" = their
  sum, the quantity the paper's formulas describe;
* "formula": the ZeRO paper (Rajbhandari et al., 2020, sec. 5) with mixed-precision Adam, K = 12: bf16 params
  2Ψ + bf16 grads 2Ψ + fp32 master / momentum / variance 12Ψ = 16Ψ, of which ZeRO-1 shards the 12Ψ
  (4Ψ + 12Ψ/N), ZeRO-2 also the grads (2Ψ + 14Ψ/N), ZeRO-3 everything (16Ψ/N); DDP: 16Ψ (Tessera's ddp runs
  bf16 as autocast over fp32 weights, so its 16Ψ is 4Ψ params + 4Ψ grads + 8Ψ moments, with no master copy);
  FSDP2 with bf16 mixed precision: fp32 parameter shards 4Ψ/N (they are the master copy) + fp32 gradient shards
  4Ψ/N (fp32 reduce) + AdamW 8Ψ/N = 16Ψ/N, N = the shard group (hsdp: `--hsdp-shard`, not the world size);
* "gathered": FSDP's all-gathered bf16 compute copies of the parameters, transient and not a model state; its
  formula is 2 x (root + largest block) with reshard_after_forward=true (the root stays gathered from its
  forward to the end of backward, one block at a time besides), 2Ψ with false (every block stays gathered from
  its forward until its backward);
* "DS estimate": DeepSpeed's estimator for the same setup, without offload (the per-GPU figure that
  `estimate_zero2_model_states_mem_needs_all_cold` / `estimate_zero3_model_states_mem_needs_all_cold` print;
  zero2's for ZeRO-1, which has none of its own): 2Ψ + 18Ψ/N and 4·largest_layer + 18Ψ/N. Its 18 counts the
  bf16 and the fp32 copy of the gradient partition (2 + 4) on top of the paper's 12;
* "buffers": ZeRO's gradient-reduction buckets as allocated (`reduce_bucket_size` elements each; the part
  gradients occupy is in "grads"); FSDP's communication buffers (flat bf16 all-gather outputs: the last one,
  kept for the next all-gather, and in backward the prefetched block's; the fp32 reduce-scatter input of one
  block). These are not model states, and no formula counts them.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
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

ZERO = ("zero1", "zero2", "zero3", "zero3_offload")
FSDP = ("fsdp", "fsdp_noreshard", "hsdp")
STRATEGIES = (*ZERO, "ddp", *FSDP)
DEFAULTS = dict(model="llama_100m", world_sizes="2,4", strategies="zero1,zero2,zero3,ddp,fsdp,fsdp_noreshard,hsdp")
QUICK = dict(model="tiny", world_sizes="2", strategies="zero2,zero3,fsdp")
# --quick shrinks the preset to a debug size: the smoke test runs in seconds of compute.
QUICK_MODEL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
               "model.intermediate_size=128", "data.embedded_documents=400"]


# ---------------------------------------------------------------------------------------------------------------
# Reference figures
# ---------------------------------------------------------------------------------------------------------------
def paper_formula(strategy: str, psi: int, n: int) -> dict:
    """Bytes per rank from the ZeRO paper (mixed-precision Adam, K = 12), split into its parts. FSDP: n is the
    shard group's size."""
    if strategy in FSDP:
        # FSDP2 + MixedPrecisionPolicy(bf16 params, fp32 reduce): the fp32 shards are the parameters and the master
        # copy at once; gradient shards in fp32; AdamW's two moments. ZeRO-3's 16Ψ/N in another split.
        parts = {"params": 4 * psi / n, "grads": 4 * psi / n, "optim_master": 8 * psi / n}
        text = "16Ψ/N" if strategy != "hsdp" else f"16Ψ/{n}"
    elif strategy == "ddp":
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
    if strategy not in ZERO:
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


def hsdp_degrees(a, n: int):
    """(replicate, shard) for hsdp at world size n, or None where it would not replicate (that is fsdp)."""
    shard = a.hsdp_shard
    if n % shard or n // shard < 2:
        return None
    return n // shard, shard


def strategy_overrides(a, strategy: str, n: int) -> list:
    if strategy == "fsdp":
        return ["strategy=fsdp", "strategy.reshard_after_forward=true"]
    if strategy == "fsdp_noreshard":
        return ["strategy=fsdp", "strategy.reshard_after_forward=false"]
    if strategy == "hsdp":
        replicate, shard = hsdp_degrees(a, n)
        return ["strategy=hsdp", f"strategy.dp_replicate={replicate}", f"strategy.dp_shard={shard}"]
    return [f"strategy={strategy}"]


def run_overrides(a, strategy: str, n: int) -> list:
    return [
        f"model={a.model}", *(QUICK_MODEL if a.quick else []), *strategy_overrides(a, strategy, n), "precision=bf16",
        f"data.seq_len={a.seq_len}", "train.max_steps=1", f"train.global_batch_size={n}", "train.micro_batch_size=1",
        "train.log_every=1", "eval.every=0", "eval.at_start=false", "eval.at_end=false", "export.hf_at_end=false",
        "checkpoint.every=0", "checkpoint.at_end=false", "checkpoint.resume=none", "logging.progress=false",
        "logging.tensorboard=false", *a.set,
    ]


def _launcher(name: str) -> str:
    path = os.path.join(VENV_BIN, name)
    return path if os.path.exists(path) else shutil.which(name) or name


def remove_deepspeed_shm(port: int) -> None:
    """DeepSpeed's CPU accelerator creates one /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    (66 MB) per rank and never unlinks it (deepspeed/ops/csrc/cpu/comm/shm.cpp: shared_close is not called):
    remove this run's, after the run."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        with contextlib.suppress(OSError):
            os.remove(path)


def measure(a, strategy: str, n: int, work: str) -> dict:
    run_dir = os.path.join(work, f"{strategy}-ws{n}")
    log_path = run_dir + ".log"
    port = free_port()
    main_py = os.path.join(ROOT, "trainer", "main.py")
    if strategy in ZERO:
        cmd = [_launcher("deepspeed"), "--num_gpus", str(n), "--master_port", str(port), main_py]
    else:
        cmd = [_launcher("torchrun"), f"--nproc_per_node={n}", f"--master_port={port}", main_py]
    cmd += [*run_overrides(a, strategy, n), f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(a.threads))
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout)
    finally:
        if strategy in ZERO:
            remove_deepspeed_shm(port)
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

    layout = mem.get("fsdp")
    shard = layout["shard_size"] if layout else n  # FSDP's formulas divide by the shard group, not the world
    formula = paper_formula(strategy, psi, shard)
    estimate, printout = deepspeed_estimate(strategy, psi, mem["largest_layer_params"], n)
    gathered_formula = gathered_text = None
    if layout:
        units = layout["unit_params"]  # the root's first, then the blocks
        if strategy == "fsdp_noreshard":
            gathered_formula, gathered_text = 2 * psi, "2Ψ"
        else:
            gathered_formula, gathered_text = 2 * (units[0] + max(units[1:], default=0)), "2(root+block)"
    label = strategy
    if strategy == "hsdp":
        label = f"hsdp {n // shard}x{shard}"
    elif strategy == "fsdp_noreshard":
        label = "fsdp, no reshard"
    row = {
        "strategy": strategy, "label": label, "world_size": n, "shard_size": shard if layout else None,
        "num_params": psi, "largest_layer_params": mem["largest_layer_params"],
        "fsdp_unit_params": layout["unit_params"] if layout else None,
        "gathered": top("gathered") if layout else None, "gathered_formula": gathered_formula,
        "gathered_formula_text": gathered_text,
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
            "| measured/formula | DS estimate | measured/DS | gathered (formula) | buffers (allocated) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        at = "/".join(p.replace("backward_end", "bwd end").replace("optimizer_step", "in step")
                      .replace("after_step", "after") for p in r["grads_peak_at"])
        gathered = "—" if r.get("gathered") is None else \
            f"{_m(r['gathered'])} ({r['gathered_formula_text']} = {_m(r['gathered_formula'])})"
        lines.append(
            f"| {r.get('label', r['strategy'])} | {r['world_size']} | {_m(r['params'])} | {_m(r['grads'])} ({at}) | "
            f"{_m(r['optim_master'])} | {_m(r['model_states'])} | {_m(r['between_steps'])} | "
            f"{r['formula_text']} = {_m(r['formula'])} | {r['ratio_formula']:.2f} | {_m(r['deepspeed_estimate'])} | "
            f"{'—' if r['ratio_estimate'] is None else format(r['ratio_estimate'], '.2f')} | {gathered} | "
            f"{_m(r['buffers'])} |")
    return "\n".join(lines)


NOTES = """\
Notes (DeepSpeed's behaviour read in its source, 0.19.8, and seen in these figures; CPU accelerator, bf16, gradient
accumulation dtype = bf16, overlap_comm and contiguous_gradients on, as Tessera configures it):
* Per-rank MiB; each column is the largest rank's peak over the points of the first step (end of backward,
  inside the optimizer step, after it; FSDP: each module's forward and backward instead of the end of backward);
  "model states" = params + grads + optim+master; "between steps" = the same four measured after the step (what
  stays allocated from one step to the next). For fsdp / hsdp, N in the formulas is the shard group's size.
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
  The AdamW `step` counters (4 bytes per parameter tensor) are counted in optim+master.
* fsdp / hsdp (FSDP2 fully_shard on every decoder block and the root, MixedPrecisionPolicy(bf16, reduce fp32)):
  the parameters are DTensors whose local shards are fp32 (4Ψ/N, the master copy), AdamW's moments are shards
  of them (8Ψ/N), and after backward each parameter's .grad is an fp32 shard (4Ψ/N; views into one
  reduce-scatter output per block) until zero_grad: 16Ψ/N, with N the shard group (hsdp replicates it
  dp_replicate times; only the gradients' all-reduce across replicas differs). Between steps 12Ψ/N. The bf16
  compute copies ("gathered") exist only in forward and backward: with reshard_after_forward=true the root's
  (FSDP never reshards the root after forward) plus one block's; with false every block's, 2Ψ, from the end of
  forward until each block's backward (the ZeRO-2-like mode: no second all-gather in backward). The FSDP
  peaks are measured at each FSDP module's forward and backward in the first micro-batch. "buffers" are FSDP's
  flat all-gather outputs (the last one, kept until the next all-gather; in backward also the prefetched next
  block's, before it is copied out) and one block's fp32 reduce-scatter input; a block's unsharded bf16
  gradients before their reduce-scatter are not seen."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=f"preset in conf/model (default {DEFAULTS['model']})")
    ap.add_argument("--world-sizes", help=f"comma-separated (default {DEFAULTS['world_sizes']})")
    ap.add_argument("--strategies", help=f"comma-separated, of {', '.join(STRATEGIES)} (default "
                                         f"{DEFAULTS['strategies']})")
    ap.add_argument("--hsdp-shard", type=int, default=2,
                    help="hsdp's shard group size (strategy.dp_shard); dp_replicate = N / it (default 2)")
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank (default 1)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra Hydra override for every run, e.g. --set strategy.reduce_bucket_size=5e6")
    ap.add_argument("--quick", action="store_true",
                    help="a debug-size model, world size 2, zero2 + zero3 + fsdp (the smoke test)")
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
    bad = [s for s in a.strategy_list if s not in STRATEGIES]
    if bad or not a.strategy_list or not a.world_size_list or min(a.world_size_list) < 1 or a.hsdp_shard < 1:
        ap.error(f"--strategies must name {'/'.join(STRATEGIES)} (got {bad or a.strategies}), --world-sizes and "
                 f"--hsdp-shard positive integers")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench-memory-")
    rows = []
    try:
        for n in a.world_size_list:
            for strategy in a.strategy_list:
                if strategy == "hsdp" and hsdp_degrees(a, n) is None:
                    print(f"hsdp N={n}: skipped (shard groups of {a.hsdp_shard} ranks leave no replica)", flush=True)
                    continue
                mem = measure(a, strategy, n, work)
                row = summarize(strategy, n, mem)
                rows.append(row)
                print(f"{row['label']} N={n}: model states {_m(row['model_states'])} MiB per rank (formula "
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
          "momentum, variance 12Ψ = 16Ψ. FSDP2 (bf16 compute, fp32 reduce): fp32 param shards 4Ψ/N + fp32 grad "
          "shards 4Ψ/N + AdamW 8Ψ/N = 16Ψ/N (N = shard group), plus transient bf16 gathered params.")
    print()
    print(table(rows))
    print()
    print(NOTES)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)) or ".", exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump({"config": {"model": a.model, "quick": a.quick, "world_sizes": a.world_size_list,
                                  "strategies": a.strategy_list, "hsdp_shard": a.hsdp_shard,
                                  "seq_len": a.seq_len, "threads": a.threads,
                                  "precision": "bf16", "extra_overrides": a.set},
                       "rows": rows}, fh, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
