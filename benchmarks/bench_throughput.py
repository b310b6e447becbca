#!/usr/bin/env python
"""Training throughput of the Tessera trainer against a bare PyTorch loop on the same work.

    python benchmarks/bench_throughput.py                        # tiny model, fp32, strategy=single
    python benchmarks/bench_throughput.py --model llama_10m --precision bf16 --repeats 3 --out /tmp/b.json
    python benchmarks/bench_throughput.py --quick                # seconds of compute (the smoke test uses it)

Both sides run in their own fresh process with the same OMP_NUM_THREADS, one after the other (alternating
bare/trainer, trainer/bare, ... so that drift in machine load hits both alike), and the median of the repeats
is reported:

* trainer: `python trainer/main.py` with Hydra overrides (eval, export, progress bar and checkpoints off,
  constant lr), logging every `log_every = gcd(warmup, steps)` steps. Its metrics.jsonl gives, for each logged
  window, the tokens (difference of the cumulative `tokens`) and the wall time (`tokens / tokens_per_s`);
  the windows that end within the warm-up are dropped, and throughput is the measured windows' tokens over
  their summed time.
* bare: this script in worker mode. The same config (composed by Hydra from the same overrides), the same
  model from models.registry (same seed), AdamW with the same lr/betas/eps/weight decay (decay on matrices
  only, as the trainer does) and the same kernel (`optim.implementation`: torch's fused one by default), the
  same global batch, micro-batch and gradient accumulation over the run's own training sequences (--bare-data
  random: random token ids), all cut into micro-batches before the loop;
  forward (use_cache=False) -> summed cross entropy / tokens -> backward -> clip_grad_norm_ -> step ->
  zero_grad. It is timed the same way: windows of `log_every` steps closed by a host sync, warm-up dropped.

The "best window" line (the fastest measured window of any repeat, per side) is a cross-check on a busy
machine: other load only ever slows a window down.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULTS = dict(model="tiny", precision="fp32", strategy="single", seq_len=128, global_batch=16, micro_batch=8,
                warmup=5, steps=15, repeats=3)
QUICK = dict(model="tiny", precision="fp32", strategy="single", seq_len=32, global_batch=4, micro_batch=2,
             warmup=2, steps=2, repeats=1)


# ---------------------------------------------------------------------------------------------------------------
# Shared: the overrides that define the run (both sides compose the same config from them)
# ---------------------------------------------------------------------------------------------------------------
def run_overrides(a) -> list:
    """Hydra overrides common to the trainer and the bare loop."""
    return [
        f"model={a.model}", f"strategy={a.strategy}", f"precision={a.precision}",
        "scheduler=constant", "scheduler.warmup_steps=0",  # the bare loop runs a constant lr
        f"data.seq_len={a.seq_len}", f"train.global_batch_size={a.global_batch}",
        f"train.micro_batch_size={a.micro_batch}", f"train.max_steps={a.warmup + a.steps}",
        f"train.log_every={a.log_every}",
        "eval.every=0", "eval.at_end=false", "export.hf_at_end=false", "logging.progress=false",
        "logging.tensorboard=false", "checkpoint.every=0", "checkpoint.resume=none",
        *a.set,
    ]


def window_throughput(windows, warmup: int):
    """windows: [(end_step, tokens, seconds)] -> (tokens/s over the windows that end after the warm-up, their
    tokens, their seconds, the best of those windows' tokens/s)."""
    kept = [(t, s) for end, t, s in windows if end > warmup]
    tokens, seconds = sum(t for t, _ in kept), sum(s for _, s in kept)
    best = max((t / s for t, s in kept if s > 0), default=0.0)
    return tokens / seconds if seconds > 0 else 0.0, tokens, seconds, best


# ---------------------------------------------------------------------------------------------------------------
# The bare PyTorch loop (worker mode: one fresh process per measurement)
# ---------------------------------------------------------------------------------------------------------------
def bare_worker(spec_path: str) -> None:
    with open(spec_path) as fh:
        spec = json.load(fh)
    sys.path.insert(0, ROOT)
    import torch
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir

    from models import registry
    from trainer.cli import register_resolvers
    from trainer.config import register_configs, to_object

    torch.set_num_threads(spec["threads"])
    register_resolvers()
    register_configs()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        cfg = to_object(compose(config_name="config", overrides=spec["overrides"]))
    t = cfg.train
    warmup, log_every, total = spec["warmup"], spec["log_every"], t.max_steps

    dev = t.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda:0" if dev == "cuda" else dev)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    import transformers
    transformers.utils.logging.disable_progress_bar()
    tokenizer = registry.load_tokenizer(cfg.model)
    info = registry.describe(cfg.model, tokenizer)
    model = registry.build(cfg.model, info, t.seed).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    torch.manual_seed(t.seed)

    o = cfg.optim
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": o.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    from trainer.optim import implementation_kwargs  # the kernel the trainer's config picks (fused by default)

    opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                            **implementation_kwargs(o.implementation, decay + no_decay, o.name))

    p = cfg.precision
    amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[p.name]
    scaler = None
    if p.name == "fp16":
        scaler = torch.amp.GradScaler(device.type, init_scale=p.init_scale, growth_factor=p.growth_factor,
                                      backoff_factor=p.backoff_factor, growth_interval=p.growth_interval)

    # A few distinct global batches, cut into contiguous (input, label) micro-batches before the loop starts:
    # the run's own training sequences (data=corpus: the trainer's tokenized data, taken in order) or random ids.
    L, gbs, mbs = cfg.data.seq_len, t.global_batch_size, t.micro_batch_size
    n_batches = min(4, total)
    if spec["data"] == "corpus":
        from trainer.data.datasets import build_data

        train = build_data(cfg, tokenizer, info.vocab_size, log=lambda msg: None).train
        if cfg.data.kind == "sft":
            raise SystemExit("--bare-data corpus: SFT data has masked labels; use --bare-data random")
        n_batches = max(1, min(n_batches, len(train) // gbs))
        batches = [train.get(list(range(b * gbs, (b + 1) * gbs))) for b in range(n_batches)]
        rows = [torch.cat([d["input_ids"], d["labels"][:, -1:]], dim=1) for d in batches]
    else:
        gen = torch.Generator().manual_seed(t.seed)
        rows = [torch.randint(0, len(tokenizer), (gbs, L + 1), generator=gen, dtype=torch.int64)
                for _ in range(n_batches)]
    pool = [[(r[i:i + mbs, :-1].contiguous(), r[i:i + mbs, 1:].contiguous()) for i in range(0, gbs, mbs)]
            for r in rows]
    n_target = gbs * L

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    params = list(model.parameters())
    model.train()
    windows, loss_sum = [], torch.zeros((), device=device)
    sync()
    t_mark = time.perf_counter()
    for step in range(total):
        loss_sum.zero_()
        for x, y in pool[step % len(pool)]:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if amp_dtype is None:
                logits = model(input_ids=x, use_cache=False).logits
            else:
                with torch.autocast(device_type=device.type, dtype=amp_dtype):
                    logits = model(input_ids=x, use_cache=False).logits
            ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            loss = ce / n_target
            (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_sum += ce.detach()
        if scaler is not None:
            scaler.unscale_(opt)
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        else:
            torch.nn.utils.get_total_norm([q.grad for q in params if q.grad is not None], 2.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done % log_every == 0 or done == total:
            last_loss = loss_sum.item() / n_target  # a host sync, as the trainer's logged loss is
            sync()
            now = time.perf_counter()
            windows.append((done, ((done - 1) % log_every + 1) * n_target, now - t_mark))
            t_mark = now
    tok_s, tokens, seconds, best = window_throughput(windows, warmup)
    out = {"tokens_per_s": tok_s, "tokens": tokens, "seconds": seconds, "best_window_tokens_per_s": best,
           "windows": windows,
           "final_loss": last_loss, "num_params": num_params, "device": str(device),
           "threads": torch.get_num_threads()}
    with open(spec["out"], "w") as fh:
        json.dump(out, fh)


# ---------------------------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------------------------
def _run(cmd, env, log_path: str, timeout):
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        with open(log_path) as fh:
            tail = fh.read()[-3000:]
        raise SystemExit(f"bench_throughput: `{' '.join(cmd[:3])} ...` failed (exit {proc.returncode}):\n{tail}")


def measure_bare(a, env, work: str, tag: str) -> dict:
    spec_path, out_path = os.path.join(work, f"{tag}.spec.json"), os.path.join(work, f"{tag}.json")
    with open(spec_path, "w") as fh:
        json.dump({"overrides": run_overrides(a), "warmup": a.warmup, "log_every": a.log_every,
                   "threads": a.threads, "data": a.bare_data, "out": out_path}, fh)
    _run([sys.executable, os.path.abspath(__file__), "--bare-worker", spec_path], env,
         os.path.join(work, f"{tag}.log"), a.timeout)
    with open(out_path) as fh:
        return json.load(fh)


def measure_trainer(a, env, work: str, tag: str) -> dict:
    run_dir = os.path.join(work, tag)
    log_path = os.path.join(work, f"{tag}.log")
    _run([sys.executable, os.path.join(ROOT, "trainer", "main.py"), *run_overrides(a), f"hydra.run.dir={run_dir}"],
         env, log_path, a.timeout)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    windows, prev = [], 0
    for r in records:
        tokens = r["tokens"] - prev
        prev = r["tokens"]
        windows.append((r["step"], tokens, tokens / r["tokens_per_s"] if r["tokens_per_s"] > 0 else 0.0))
    expected = sorted({*range(a.log_every, a.warmup + a.steps + 1, a.log_every), a.warmup + a.steps})
    if [w[0] for w in windows] != expected:
        raise SystemExit(f"bench_throughput: the trainer logged steps {[w[0] for w in windows]}, "
                         f"expected {expected} (see {log_path})")
    tok_s, tokens, seconds, best = window_throughput(windows, a.warmup)
    with open(log_path) as fh:
        m = re.search(r"\| device (\S+) \|", fh.read())
    return {"tokens_per_s": tok_s, "tokens": tokens, "seconds": seconds, "best_window_tokens_per_s": best,
            "windows": windows,
            "final_loss": records[-1]["loss"], "device": m.group(1) if m else None}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=f"preset in conf/model (default {DEFAULTS['model']})")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default fp32")
    ap.add_argument("--strategy", choices=("single", "ddp"),
                    help="trainer strategy (default single); ddp runs one rank, so the ratio shows the cost of "
                         "the DDP wrapper; the bare loop is always one plain process")
    ap.add_argument("--steps", type=int, help=f"measured optimizer steps (default {DEFAULTS['steps']})")
    ap.add_argument("--warmup", type=int, help=f"discarded warm-up steps (default {DEFAULTS['warmup']})")
    ap.add_argument("--seq-len", type=int, help=f"default {DEFAULTS['seq_len']}")
    ap.add_argument("--global-batch", type=int, help=f"sequences per optimizer step (default "
                                                     f"{DEFAULTS['global_batch']})")
    ap.add_argument("--micro-batch", type=int, help=f"sequences per forward/backward (default "
                                                    f"{DEFAULTS['micro_batch']})")
    ap.add_argument("--repeats", type=int, help="measurements of each side, alternating (default 2)")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS for both sides (default: $OMP_NUM_THREADS, else the CPU count, which "
                         "is what the trainer would use on its own)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra Hydra override applied to both sides, e.g. --set model.name_or_path=/m "
                         "(repeatable)")
    ap.add_argument("--bare-data", choices=("corpus", "random"), default="corpus",
                    help="the bare loop's sequences: the run's training data (default) or random token ids")
    ap.add_argument("--quick", action="store_true", help="tiny and short (the smoke test)")
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, metrics.jsonl)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per measurement process")
    ap.add_argument("--bare-worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.bare_worker:
        return a
    base = QUICK if a.quick else DEFAULTS
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.warmup < 1 or a.steps < 1 or a.repeats < 1:
        ap.error("--warmup, --steps and --repeats must be >= 1 (the first window holds the start-up)")
    if a.global_batch % a.micro_batch:
        ap.error("--global-batch must be a multiple of --micro-batch")
    if a.threads is None:
        a.threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    a.log_every = math.gcd(a.warmup, a.steps)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.bare_worker:
        bare_worker(a.bare_worker)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads),
               TOKENIZERS_PARALLELISM="false")
    work = tempfile.mkdtemp(prefix="tessera-bench-")
    accum = a.global_batch // a.micro_batch
    print(f"model {a.model} | strategy {a.strategy} | precision {a.precision} | seq_len {a.seq_len} | global batch "
          f"{a.global_batch} = micro {a.micro_batch} x accum {accum} | {a.warmup} warm-up + {a.steps} measured "
          f"steps (windows of {a.log_every}) | {a.repeats} repeat(s) | OMP_NUM_THREADS={a.threads}", flush=True)
    runs = {"bare": [], "trainer": []}
    try:
        for i in range(a.repeats):
            order = ("bare", "trainer") if i % 2 == 0 else ("trainer", "bare")  # ABBA: linear drift cancels
            for side in order:
                t0, load = time.perf_counter(), os.getloadavg()[0]
                fn = measure_bare if side == "bare" else measure_trainer
                r = fn(a, env, work, f"{side}{i}")
                r["loadavg_1min_before"] = load
                runs[side].append(r)
                print(f"  repeat {i + 1} {side:7s} {r['tokens_per_s']:10.1f} tok/s  ({r['tokens']} tokens in "
                      f"{r['seconds']:.2f} s; best window {r['best_window_tokens_per_s']:.1f} tok/s; process "
                      f"{time.perf_counter() - t0:.1f} s; load before {load:.2f})", flush=True)
    finally:
        if a.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    bare = statistics.median(r["tokens_per_s"] for r in runs["bare"])
    trainer = statistics.median(r["tokens_per_s"] for r in runs["trainer"])
    ratio = trainer / bare if bare > 0 else float("nan")
    paired = [t["tokens_per_s"] / b["tokens_per_s"] for b, t in zip(runs["bare"], runs["trainer"])
              if b["tokens_per_s"] > 0]
    best_bare = max(r["best_window_tokens_per_s"] for r in runs["bare"])
    best_trainer = max(r["best_window_tokens_per_s"] for r in runs["trainer"])
    ratio_best = best_trainer / best_bare if best_bare > 0 else float("nan")
    b0 = runs["bare"][0]
    if runs["trainer"][0].get("device") not in (None, b0["device"].split(":")[0], b0["device"]):
        print(f"warning: the trainer ran on {runs['trainer'][0]['device']}, the bare loop on {b0['device']}")

    print()
    print(f"{'':22s}{'tokens/s (median)':>18s}   runs")
    print(f"{'bare PyTorch loop':22s}{bare:18.1f}   " + " ".join(f"{r['tokens_per_s']:.1f}" for r in runs["bare"]))
    print(f"{'Tessera trainer':22s}{trainer:18.1f}   " + " ".join(f"{r['tokens_per_s']:.1f}" for r in runs["trainer"]))
    print(f"{'ratio trainer/bare':22s}{ratio:18.3f}   paired: " + " ".join(f"{x:.3f}" for x in paired))
    print(f"{'best window':22s}{'':18s}   bare {best_bare:.1f}, trainer {best_trainer:.1f}, ratio {ratio_best:.3f} "
          f"(load only slows a window down: a cross-check on a busy machine)")
    print(f"({b0['num_params'] / 1e6:.2f}M params, device {b0['device']}, {b0['threads']} torch threads; "
          f"final loss bare {b0['final_loss']:.3f} ({a.bare_data} data), "
          f"trainer {runs['trainer'][0]['final_loss']:.3f})")

    if a.out:
        result = {
            "config": {"model": a.model, "strategy": a.strategy, "precision": a.precision, "seq_len": a.seq_len,
                       "global_batch": a.global_batch, "micro_batch": a.micro_batch, "grad_accum": accum,
                       "warmup_steps": a.warmup, "measured_steps": a.steps, "log_every": a.log_every,
                       "repeats": a.repeats, "threads": a.threads, "bare_data": a.bare_data, "extra_overrides": a.set,
                       "device": b0["device"], "num_params": b0["num_params"]},
            "bare_tokens_per_s": bare, "trainer_tokens_per_s": trainer, "ratio": ratio, "paired_ratios": paired,
            "best_window": {"bare_tokens_per_s": best_bare, "trainer_tokens_per_s": best_trainer,
                            "ratio": ratio_best},
            "runs": runs,
        }
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
