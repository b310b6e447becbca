#!/usr/bin/env python
"""Tessera's tokens/s against other training loops on the same model, data, batch, optimizer and steps, in one
process each: a bare PyTorch loop (`bare`) and the Hugging Face Trainer (`hf`), and the ratios.

    python benchmarks/bench_throughput.py                           # tiny preset, fp32, bare and hf, 3 repeats
    python benchmarks/bench_throughput.py --model llama_10m --precision bf16 --against bare --out /tmp/t.json
    python benchmarks/bench_throughput.py --quick                   # debug-size model (the tests run it)

See benchmarks/README.md for what each figure means and how it is measured.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

FULL = dict(model="tiny", precision="fp32", seq_len=128, global_batch=16, micro_batch=8, warmup=5, steps=15)
QUICK = dict(model="tiny", precision="fp32", seq_len=32, global_batch=4, micro_batch=2, warmup=2, steps=4)


def bare_loop(spec) -> list:
    """forward -> summed cross entropy / target tokens -> backward -> clip -> AdamW step -> zero_grad; returns
    the wall time at the end of every step (after a host sync)."""
    import torch
    import torch.nn.functional as F

    cfg, model, train = C.build_model_and_data(spec)
    t = cfg.train
    opt = C.adamw(cfg, model)
    amp = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision.name]
    mbs, n_target = t.micro_batch_size, t.global_batch_size * cfg.data.seq_len
    device = C.train_device(cfg).type  # where the trainer would run
    model.to(device)
    batches = [{k: v.to(device) for k, v in train.get(ix).items() if k in ("input_ids", "labels")}
               for ix in C.global_batch_indices(cfg, train)]
    ends = []
    for step in range(t.max_steps):
        batch = batches[step % len(batches)]
        for i in range(0, t.global_batch_size, mbs):
            x, y = batch["input_ids"][i:i + mbs], batch["labels"][i:i + mbs]
            with torch.autocast(device, dtype=amp, enabled=amp is not None):
                logits = model(input_ids=x, use_cache=False).logits
            (F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / n_target).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    return ends


def hf_trainer(spec) -> list:
    """transformers.Trainer on the same model and sequences, one process (common.hf_train)."""
    cfg, model, train = C.build_model_and_data(spec)
    return C.hf_train(cfg, model, train, spec["work"])


def measure(a, side: str, work: str, tag: str) -> float:
    overrides = [*C.shape_overrides(a), "strategy=single"]
    env = C.thread_env(a.threads)
    if side == "tessera":
        run = C.run_trainer(overrides, 1, os.path.join(work, tag), env, a.timeout)
        return C.tokens_per_s(run["metrics"], a.warmup)
    spec = {"overrides": overrides, "threads": a.threads, "side": side, "work": os.path.join(work, tag),
            "out": os.path.join(work, tag + ".json")}
    with open(spec["out"], "w") as fh:
        json.dump(spec, fh)
    from trainer.launch.choose import run_process_group

    done = run_process_group([sys.executable, os.path.abspath(__file__), "--worker", spec["out"]], env=env,
                             timeout=a.timeout)
    if done.returncode != 0:
        raise C.RunFailed(f"{side} loop: exit {done.returncode}: {done.stderr.strip()[-1500:]}")
    ends = json.load(open(spec["out"]))["step_ends"]
    return a.global_batch * a.seq_len * (len(ends) - a.warmup) / (ends[-1] - ends[a.warmup - 1])


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:  # one baseline, in a fresh process
        spec = json.load(open(sys.argv[2]))
        spec["step_ends"] = (bare_loop if spec["side"] == "bare" else hf_trainer)(spec)
        json.dump(spec, open(sys.argv[2], "w"))
        return 0
    ap = C.shape_parser(__doc__, FULL, QUICK)
    ap.add_argument("--against", default="bare,hf", help="baselines, comma list of bare, hf (default both)")
    ap.add_argument("--repeats", type=int, default=None, help="measurements per side, order rotated (default 3; "
                                                                "--quick 1); medians are reported")
    a = C.finish_shape(ap, ap.parse_args(argv))
    baselines = [b for b in a.against.split(",") if b]
    if not baselines or set(baselines) - {"bare", "hf"}:
        ap.error("--against takes a comma list of bare, hf")
    a.repeats = a.repeats or (1 if a.quick else 3)
    sides = ["tessera", *baselines]
    work = tempfile.mkdtemp(prefix="tessera-throughput-")
    runs = {s: [] for s in sides}
    try:
        for i in range(a.repeats):
            for side in sides[i % len(sides):] + sides[:i % len(sides)]:  # rotate: slow drift hits every side
                runs[side].append(measure(a, side, work, f"{side}{i}"))
                print(f"repeat {i + 1} {side:8s} {runs[side][-1]:10.1f} tok/s", flush=True)
    except C.RunFailed as e:
        C.fail("bench_throughput", str(e))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {s: statistics.median(v) for s, v in runs.items()}
    ratios = {b: median["tessera"] / median[b] for b in baselines}
    names = {"tessera": "Tessera trainer", "bare": "bare PyTorch loop", "hf": "Hugging Face Trainer"}
    print("\n" + C.markdown_table(["loop", "tokens/s (median)", "runs", "Tessera / this"],
                                  [[names[s], f"{median[s]:.1f}", " ".join(f"{x:.1f}" for x in runs[s]),
                                    f"{ratios[s]:.3f}" if s in ratios else "—"] for s in sides]))
    C.write_json(a.out, {"config": {k: getattr(a, k) for k in (*FULL, "threads", "repeats", "set")},
                         "tokens_per_s": median, "runs": runs, "ratio": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
