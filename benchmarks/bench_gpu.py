#!/usr/bin/env python
"""One short, prepared GPU run: tokens/s and MFU of ~0.5B and ~1B Llama-style presets in bf16 under FSDP2
(without and with torch.compile) and DeepSpeed ZeRO-3.

    python benchmarks/bench_gpu.py --dry-run            # print the plan and the exact commands; runs nothing
    python benchmarks/bench_gpu.py                      # all 6 rows on every local GPU (a few minutes)
    python benchmarks/bench_gpu.py --sizes 1b --rows fsdp,zero3 --steps 5 --out-dir /tmp/gpu

Each row is one real training run of trainer/main.py through the launcher launch.sh would pick (torchrun for
fsdp, the deepspeed launcher for zero3) on all local GPUs (--nproc, default: every visible GPU), embedded data,
precision=bf16, global batch = micro-batch x GPUs (no accumulation), `--warmup` steps not measured (compile
happens there) and `--steps` measured steps, eval / checkpoints / export off. The model is `model=llama_100m`
with its shape overridden (no new preset files):

    0.5b: hidden 1536, 20 layers, 24 heads (8 KV heads), MLP 4096        (~0.50B parameters)
    1b:   hidden 2048, 22 layers, 32 heads (4 KV heads), MLP 5632        (~0.97B parameters, TinyLlama's shape)

Per row it reads the run's metrics.jsonl and prints tokens/s (all positions, per GPU and in all) over the
measured steps, the trainer's logged `mfu`, and the MFU recomputed here from the same formula as a check:
FLOPs per token = 6N + 12·L·d·T (N = parameters without the input embedding, L layers, d hidden, T seq_len),
MFU = tokens/s x FLOPs per token / (GPUs x the device's dense bf16 peak: 989 TFLOP/s for H100 / H200 SXM; see
trainer/metrics.py KNOWN_PEAKS, or --peak-tflops, which is passed to the trainer as logging.peak_tflops).
A report (report.md, results.json and each run's log) is written to --out-dir.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

SIZES = {
    "0.5b": dict(hidden_size=1536, num_layers=20, num_heads=24, num_kv_heads=8, intermediate_size=4096),
    "1b": dict(hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4, intermediate_size=5632),
}
ROWS = {
    "fsdp": ("fsdp", ["train.compile=false"]),
    "fsdp_compile": ("fsdp", ["train.compile=true"]),
    "zero3": ("zero3", []),
}
QUIET = ["eval.every=0", "eval.at_start=false", "eval.at_end=false", "export.hf_at_end=false",
         "checkpoint.every=0", "checkpoint.at_end=false", "checkpoint.resume=none", "logging.progress=false",
         "logging.tensorboard=false", "scheduler=constant", "scheduler.warmup_steps=0", "train.log_every=1"]


def size_overrides(size: str, seq_len: int) -> list:
    s = SIZES[size]
    return ["model=llama_100m", *(f"model.{k}={v}" for k, v in s.items()),
            f"model.max_position_embeddings={max(2048, seq_len)}"]


def model_counts(size: str, seq_len: int) -> dict:
    """Parameters of the preset (from its Hugging Face config; nothing is built) and FLOPs per token."""
    from hydra import compose, initialize_config_dir

    from models import registry
    from trainer.cli import register_resolvers
    from trainer.config import register_configs, to_object

    register_resolvers()
    register_configs()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        cfg = to_object(compose(config_name="config", overrides=size_overrides(size, seq_len)))
    tok = registry.load_tokenizer(cfg.model)
    info = registry.describe(cfg.model, tok)
    c = info.hf_config
    d, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    hd = getattr(c, "head_dim", None) or d // c.num_attention_heads
    per_layer = (d * c.num_attention_heads * hd + 2 * d * c.num_key_value_heads * hd + c.num_attention_heads * hd * d
                 + 3 * d * c.intermediate_size + 2 * d)
    total = V * d + L * per_layer + d + (0 if c.tie_word_embeddings else V * d)
    n_flops = total - V * d  # without the input embedding, as trainer/loop.py counts
    from trainer.metrics import flops_per_token

    return {"params": total, "params_without_input_embedding": n_flops, "layers": L, "hidden": d, "vocab": V,
            "flops_per_token": flops_per_token(n_flops, L, d, seq_len)}


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def plan(a) -> list:
    runs = []
    for size in a.size_list:
        for row in a.row_list:
            strategy, extra = ROWS[row]
            ov = [*size_overrides(size, a.seq_len), f"strategy={strategy}", "precision=bf16",
                  f"data.seq_len={a.seq_len}", f"train.micro_batch_size={a.micro_batch}",
                  f"train.global_batch_size={a.micro_batch * a.nproc}", f"train.max_steps={a.warmup + a.steps}",
                  *QUIET, *extra, *([f"logging.peak_tflops={a.peak_tflops}"] if a.peak_tflops else []), *a.set]
            run_dir = os.path.join(a.out_dir, f"{size}-{row}")
            main = os.path.join(ROOT, "trainer", "main.py")
            if strategy.startswith("zero"):
                launcher = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(a.nproc),
                            "--master_port", str(a.port)]
            else:
                launcher = [sys.executable, "-m", "trainer.torchrun", "--standalone", "--nproc_per_node",
                            str(a.nproc)]
            runs.append({"size": size, "row": row, "strategy": strategy, "run_dir": run_dir,
                         "cmd": [*launcher, main, *ov, f"hydra.run.dir={run_dir}"]})
    return runs


def read_run(run_dir: str, warmup: int) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    kept = [r for r in recs if r["step"] > warmup]
    if not kept:
        return {"error": "no measured steps in metrics.jsonl"}
    prev = {r["step"]: r for r in recs}
    seq_tokens, seconds = 0.0, 0.0
    for r in kept:
        before = prev.get(r["step"] - 1, {"tokens": 0})
        tokens = r["tokens"] - before["tokens"]
        dt = tokens / r["tokens_per_s"] if r["tokens_per_s"] > 0 else 0.0
        seconds += dt
        seq_tokens += r["seq_tokens_per_s"] * dt
    mfus = [r["mfu"] for r in kept if "mfu" in r]
    return {"seq_tokens_per_s": seq_tokens / seconds if seconds else 0.0, "seconds": seconds,
            "logged_mfu": sum(m * (r["tokens"] - prev.get(r["step"] - 1, {"tokens": 0})["tokens"])
                              for m, r in zip(mfus, kept)) / sum(
                r["tokens"] - prev.get(r["step"] - 1, {"tokens": 0})["tokens"] for r in kept) if mfus else None,
            "peak_mem_gib": max(r.get("peak_mem_gib", 0) for r in recs), "final_loss": recs[-1]["loss"],
            "measured_steps": len(kept)}


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"


def peak_for(name: str, override):
    if override:
        return override
    from trainer.metrics import KNOWN_PEAKS

    return next((p for key, p in KNOWN_PEAKS if key in name), None)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.5b,1b", help=f"comma-separated, of {', '.join(SIZES)} (default both)")
    ap.add_argument("--rows", default="fsdp,fsdp_compile,zero3",
                    help=f"comma-separated, of {', '.join(ROWS)} (default all)")
    ap.add_argument("--nproc", type=int, default=None, help="GPUs = processes (default: every visible GPU)")
    ap.add_argument("--seq-len", type=int, default=2048, help="default 2048")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="steps not measured (compile runs here; default 3)")
    ap.add_argument("--steps", type=int, default=7, help="measured steps (default 7)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16 peak per GPU when the device is not in trainer/metrics.py KNOWN_PEAKS")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra Hydra override")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "outputs", "bench-gpu", time.strftime("%Y%m%d-%H%M%S")))
    ap.add_argument("--timeout", type=float, default=420, help="seconds per run (default 420)")
    ap.add_argument("--port", type=int, default=29533, help="deepspeed launcher's master port")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    a = ap.parse_args(argv)
    a.size_list = [s for s in a.sizes.split(",") if s]
    a.row_list = [r for r in a.rows.split(",") if r]
    bad = [s for s in a.size_list if s not in SIZES] + [r for r in a.row_list if r not in ROWS]
    if bad:
        ap.error(f"unknown size/row {bad}")
    if a.nproc is None:
        a.nproc = gpu_count() or 1
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    runs = plan(a)
    counts = {s: model_counts(s, a.seq_len) for s in a.size_list}
    name = device_name()
    peak = peak_for(name, a.peak_tflops)
    print(f"device: {name} x {a.nproc} | dense bf16 peak {peak or '?'} TFLOP/s per GPU | seq_len {a.seq_len}, "
          f"micro-batch {a.micro_batch}, {a.warmup} warm-up + {a.steps} measured steps", flush=True)
    for s, c in counts.items():
        print(f"  {s}: {c['params'] / 1e9:.3f}B params ({c['params_without_input_embedding'] / 1e9:.3f}B without "
              f"the input embedding), {c['layers']} layers x {c['hidden']}, {c['flops_per_token'] / 1e9:.2f} "
              f"GFLOP per token (6N + 12·L·d·T)")
    if a.dry_run:
        print("\ncommands (--dry-run: nothing is run):")
        for r in runs:
            print(f"# {r['size']} {r['row']}\n" + " ".join(r["cmd"]))
        return 0
    if gpu_count() == 0:
        import torch

        print(f"bench_gpu: no CUDA device visible (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda or 'none'}): this script needs a GPU machine with a CUDA build of torch",
              file=sys.stderr)
        return 2
    os.makedirs(a.out_dir, exist_ok=True)
    results = []
    for r in runs:
        log_path = r["run_dir"] + ".log"
        t0 = time.time()
        print(f"[{r['size']} {r['row']}] running ...", flush=True)
        with open(log_path, "w") as log:
            try:
                rc = subprocess.run(r["cmd"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=a.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        row = {k: r[k] for k in ("size", "row", "strategy", "run_dir")}
        row.update(wall_s=time.time() - t0, command=" ".join(r["cmd"]), returncode=rc)
        if rc == 0:
            row.update(read_run(r["run_dir"], a.warmup))
            c = counts[r["size"]]
            if peak and row.get("seq_tokens_per_s"):
                row["mfu_recomputed"] = row["seq_tokens_per_s"] * c["flops_per_token"] / (peak * 1e12 * a.nproc)
        else:
            with open(log_path, errors="replace") as fh:
                row["error"] = f"exit {rc}: " + (fh.read()[-600:].strip().splitlines() or ["no output"])[-1]
        results.append(row)
        print(f"[{r['size']} {r['row']}] " + (row.get("error") or
              f"{row['seq_tokens_per_s']:.0f} tok/s, MFU logged {_pct(row.get('logged_mfu'))}, recomputed "
              f"{_pct(row.get('mfu_recomputed'))} ({row['wall_s']:.0f} s)"), flush=True)
    lines = ["# Tessera GPU benchmark\n", f"{name} x {a.nproc}, peak {peak} TFLOP/s (dense bf16) per GPU, bf16, "
             f"seq_len {a.seq_len}, micro-batch {a.micro_batch} per GPU, {a.warmup} warm-up + {a.steps} measured "
             f"steps.\n", "| size | params | row | tokens/s (all GPUs) | tokens/s per GPU | MFU (trainer) | "
             "MFU (recomputed) | peak mem GiB | run wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        c = counts[row["size"]]
        if "error" in row:
            lines.append(f"| {row['size']} | {c['params'] / 1e9:.2f}B | {row['row']} | failed: {row['error']} "
                         f"| | | | | {row['wall_s']:.0f} |")
            continue
        lines.append(f"| {row['size']} | {c['params'] / 1e9:.2f}B | {row['row']} | {row['seq_tokens_per_s']:.0f} | "
                     f"{row['seq_tokens_per_s'] / a.nproc:.0f} | {_pct(row.get('logged_mfu'))} | "
                     f"{_pct(row.get('mfu_recomputed'))} | {row['peak_mem_gib']:.1f} | {row['wall_s']:.0f} |")
    report = "\n".join(lines) + "\n"
    print("\n" + report)
    with open(os.path.join(a.out_dir, "report.md"), "w") as fh:
        fh.write(report)
    with open(os.path.join(a.out_dir, "results.json"), "w") as fh:
        json.dump({"device": name, "nproc": a.nproc, "peak_tflops": peak, "counts": counts, "rows": results}, fh,
                  indent=2)
    print(f"wrote {a.out_dir}/report.md")
    return 0 if all("error" not in r for r in results) else 1


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if x is not None else "—"


if __name__ == "__main__":
    sys.exit(main())
