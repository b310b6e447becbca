#!/usr/bin/env python
"""Communication cost against quality: the same model, data and tokens under synchronous DDP, compressed
reductions (bf16, PowerSGD rank 1 and 4), local SGD (H = 8, 32) and DiLoCo (H = 8, 32, 128; and H = 32 with outer
momentum 0.5), on 2 ranks.

    python benchmarks/bench_comm.py                       # tiny preset, 512 steps of 16 x 64 tokens, 2 ranks
    python benchmarks/bench_comm.py --steps 1024 --out /tmp/comm.json --plot /tmp/comm.png
    python benchmarks/bench_comm.py --quick               # debug-size model, 64 steps, 4 modes (what the tests run)
    python benchmarks/bench_comm.py --overhead            # ms/step with logging.comm_bytes off and on (DDP, FSDP)

Per mode: bytes per step (the trainer's comm_bytes, rank 0, averaged over every step; and sync's / this), final
train loss (mean of the last 10% of steps) and validation loss at the end, each against sync, and tokens/s.
--plot writes loss against tokens trained for every mode (needs matplotlib). See benchmarks/README.md.

--overhead: what counting the bytes costs. Per strategy (--strategies, default ddp,fsdp; 2 ranks) one run with
logging.comm_bytes=false and one with true, same shape (default: the tiny preset, 16 x 64 tokens, 5 + 40 steps;
--repeats alternates more pairs); per run the median step time after the warmup (a step: from one logged record
to the next, log_every=1), and on / off.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

FULL = dict(model="tiny", precision="fp32", seq_len=64, global_batch=16, micro_batch=8, warmup=1, steps=511)
QUICK = dict(model="tiny", precision="fp32", seq_len=32, global_batch=8, micro_batch=4, warmup=1, steps=63)
MODES = {
    "sync": [],
    "bf16": ["strategy.comm_hook=bf16"],
    "powersgd_r1": ["strategy.comm_hook=powersgd", "strategy.powersgd_rank=1"],
    "powersgd_r4": ["strategy.comm_hook=powersgd", "strategy.powersgd_rank=4"],
    "local_sgd_h8": ["sync=local_sgd", "sync.every=8"],
    "local_sgd_h32": ["sync=local_sgd", "sync.every=32"],
    "diloco_h8": ["sync=diloco", "sync.every=8"],
    "diloco_h32": ["sync=diloco", "sync.every=32"],
    # the paper's outer momentum (0.9) was tuned for 8 workers from a pre-trained start; 2 workers from scratch
    # do better with less (a sweep of (outer_lr, outer_momentum) on this benchmark: benchmarks/README.md)
    "diloco_h32_m0.5": ["sync=diloco", "sync.every=32", "sync.outer_momentum=0.5"],
    "diloco_h128": ["sync=diloco", "sync.every=128"],
}
QUICK_MODES = "sync,bf16,local_sgd_h8,diloco_h8"


def measure(a, mode: str, work: str) -> dict:
    overrides = [*C.shape_overrides(a), "strategy=ddp", *MODES[mode], "eval.at_end=true", "eval.max_sequences=256",
                 f"optim.lr={a.lr}"]
    overrides.append("logging.comm_bytes=true")  # metrics.jsonl's comm_bytes
    run = C.run_trainer(overrides, 2, os.path.join(work, mode), C.thread_env(a.threads), a.timeout)
    records = [r for r in run["metrics"] if "loss" in r]
    tail = records[-max(1, len(records) // 10):]
    return {"mode": mode, "overrides": MODES[mode],
            "comm_bytes_per_step": sum(r.get("comm_bytes", 0) for r in records) / len(records),
            "train_loss": sum(r["loss"] for r in tail) / len(tail),
            "val_loss": next((r["val_loss"] for r in reversed(run["metrics"]) if "val_loss" in r), None),
            "tokens_per_s": C.tokens_per_s(run["metrics"], a.warmup),
            "curve": [(r["tokens"], r["loss"]) for r in records]}


OVERHEAD_STRATEGIES = "ddp,fsdp"


def step_ms(records, a) -> list:
    """Each measured step's time in ms: the sequence tokens of a step over the record's seq_tokens_per_s."""
    seq_tokens = a.global_batch * a.seq_len
    return [1e3 * seq_tokens / r["seq_tokens_per_s"] for r in records
            if r["step"] > a.warmup and r.get("seq_tokens_per_s", 0) > 0]


def measure_overhead(a, work: str) -> list:
    """One row per (strategy, logging.comm_bytes): the median ms/step of each run, and whether comm_bytes logged."""
    import statistics

    rows = []
    for strategy in a.strategies.split(","):
        for repeat in range(a.repeats):
            for on in (False, True):
                name = f"{strategy}-{'on' if on else 'off'}-{repeat}"
                overrides = [*C.shape_overrides(a), f"strategy={strategy}", f"logging.comm_bytes={str(on).lower()}"]
                run = C.run_trainer(overrides, 2, os.path.join(work, name), C.thread_env(a.threads), a.timeout)
                times = step_ms(run["metrics"], a)
                logged = any("comm_bytes" in r for r in run["metrics"])
                assert logged == on, f"{name}: comm_bytes in metrics.jsonl is {logged}"
                rows.append({"strategy": strategy, "comm_bytes": on, "repeat": repeat, "steps": len(times),
                             "median_ms": statistics.median(times), "step_ms": times})
                print(f"[{name}] median {rows[-1]['median_ms']:.2f} ms/step over {len(times)} steps", flush=True)
    return rows


def report_overhead(rows) -> str:
    import statistics

    table = []
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        off = [r["median_ms"] for r in rows if r["strategy"] == strategy and not r["comm_bytes"]]
        on = [r["median_ms"] for r in rows if r["strategy"] == strategy and r["comm_bytes"]]
        off_ms, on_ms = statistics.median(off), statistics.median(on)
        table.append([strategy, len(off), f"{off_ms:.2f}", f"{on_ms:.2f}", f"{on_ms - off_ms:+.2f}",
                      f"{on_ms / off_ms:.3f}"])
    return C.markdown_table(["strategy", "runs each", "off ms/step", "on ms/step", "on - off", "on / off"], table)


def overhead_main(a) -> int:
    work = tempfile.mkdtemp(prefix="tessera-comm-overhead-")
    try:
        rows = measure_overhead(a, work)
    except (C.RunFailed, AssertionError) as e:
        print(f"failed: {e}", flush=True)
        return 1
    finally:
        if a.keep:
            print(f"runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + report_overhead(rows))
    C.write_json(a.out, {"config": {k: getattr(a, k) for k in (*FULL, "threads", "set", "strategies", "repeats")},
                         "rows": rows})
    return 0


def report(rows) -> str:
    sync = next((r for r in rows if r["mode"] == "sync" and "error" not in r), None)
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["mode"], f"failed: {r['error'][:150]}", *[""] * 6])
            continue
        fewer = f"{sync['comm_bytes_per_step'] / r['comm_bytes_per_step']:.1f}x" \
            if sync and r["comm_bytes_per_step"] else "—"
        rel = (lambda k: f"{(r[k] / sync[k] - 1) * 100:+.2f}%" if sync and r[k] and sync[k] else "—")
        table.append([r["mode"], f"{r['comm_bytes_per_step'] / 2**20:.3f}", fewer, f"{r['train_loss']:.4f}",
                      rel("train_loss"), f"{r['val_loss']:.4f}" if r["val_loss"] else "—", rel("val_loss"),
                      f"{r['tokens_per_s']:.0f}"])
    return C.markdown_table(["mode", "MiB / step", "fewer bytes than sync", "train loss", "vs sync", "val loss",
                             "vs sync", "tokens/s"], table)


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        if "curve" in r:
            tokens, losses = zip(*r["curve"])
            window = max(1, len(losses) // 32)  # a moving mean: one step's loss is noisy
            smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                      for i in range(len(losses))]
            ax.plot(tokens, smooth, label=r["mode"])
    ax.set_xlabel("target tokens trained")
    ax.set_ylabel("train loss (moving mean)")
    ax.set_title("Communication modes, same model, data and tokens (2 ranks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = C.shape_parser(__doc__, FULL, QUICK)
    ap.add_argument("--modes", help=f"comma list of {', '.join(MODES)} (default all; --quick {QUICK_MODES})")
    ap.add_argument("--lr", type=float, default=3e-3, help="inner learning rate, AdamW (default 3e-3)")
    ap.add_argument("--plot", help="write loss vs tokens as a PNG here")
    ap.add_argument("--keep", action="store_true", help="keep the run folders and logs")
    ap.add_argument("--overhead", action="store_true", help="ms/step with logging.comm_bytes off and on instead")
    ap.add_argument("--strategies", default=OVERHEAD_STRATEGIES, help=f"--overhead: default {OVERHEAD_STRATEGIES}")
    ap.add_argument("--repeats", type=int, default=1, help="--overhead: off/on pairs per strategy (default 1)")
    ns = ap.parse_args(argv)
    if ns.overhead:
        ns.warmup = 5 if ns.warmup is None else ns.warmup
        ns.steps = 40 if ns.steps is None else ns.steps
    a = C.finish_shape(ap, ns)
    if a.overhead:
        return overhead_main(a)
    modes = (a.modes or (QUICK_MODES if a.quick else ",".join(MODES))).split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown} (known: {', '.join(MODES)})")
    work = tempfile.mkdtemp(prefix="tessera-comm-")
    rows = []
    try:
        for mode in modes:
            print(f"[{mode}] ...", flush=True)
            try:
                rows.append(measure(a, mode, work))
                print(f"[{mode}] {rows[-1]['comm_bytes_per_step'] / 2**20:.3f} MiB/step, val loss "
                      f"{rows[-1]['val_loss']}", flush=True)
            except (C.RunFailed, AssertionError) as e:
                rows.append({"mode": mode, "error": str(e)})
                print(f"[{mode}] failed: {e}", flush=True)
    finally:
        if a.keep:
            print(f"runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + report(rows))
    if a.plot:
        plot(rows, a.plot)
    C.write_json(a.out, {"config": {k: getattr(a, k) for k in (*FULL, "threads", "set", "lr")}, "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
