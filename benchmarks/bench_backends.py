#!/usr/bin/env python
"""Each backend against its own limit: Tessera's tokens/s per strategy next to a bare loop on the same engine, model,
data, global batch, sequence and precision (plain DDP, a bare DeepSpeed engine loop for ZeRO-2 and ZeRO-3, a bare
FSDP2 `fully_shard` loop, a bare single-process loop), with intervals over alternating repeats, and Tessera's
per-step overhead in milliseconds (its step time less the bare loop's: the host work around the same math).

    python benchmarks/bench_backends.py                           # tiny preset, fp32, 2 ranks, 4 repeats
    python benchmarks/bench_backends.py --rows zero2,zero3 --repeats 6 --out /tmp/backends.json
    python benchmarks/bench_backends.py --quick                   # debug-size model, 1 repeat (the tests run it)

Repeats alternate the sides (Tessera, bare, Tessera, ...) so that slow drift of the machine hits both; each figure
is the median with the lowest and highest run. See benchmarks/README.md.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

FULL = dict(model="tiny", precision="fp32", seq_len=256, global_batch=8, micro_batch=2, warmup=5, steps=30)
QUICK = dict(model="tiny", precision="fp32", seq_len=32, global_batch=4, micro_batch=1, warmup=2, steps=4)
ROWS = ("single", "ddp", "zero2", "zero3", "fsdp")


# ---- the bare loops (one process per rank, started by torchrun) ------------------------------------------------
def _setup(spec):
    """Process group, config, model and this rank's micro-batches of a few global batches, built as the trainer
    builds them (the same seed, the same sequences)."""
    import torch
    import torch.distributed as dist

    from models import registry
    from trainer.data.datasets import build_data
    from trainer.data.sampler import rank_slice

    torch.set_num_threads(spec["threads"])
    cfg = C.compose(spec["overrides"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() and cfg.train.device != "cpu" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = registry.load_tokenizer(cfg.model)
    info = registry.describe(cfg.model, tokenizer)
    model = registry.build(cfg.model, info, cfg.train.seed)
    train = build_data(cfg, tokenizer, info.vocab_size, log=lambda msg: None).train
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    steps = []
    for b in range(max(1, min(4, len(train) // gbs))):
        mine = rank_slice(list(range(b * gbs, (b + 1) * gbs)), rank, world)
        steps.append([{k: v.to(device) for k, v in train.get(mine[i:i + mbs]).items()
                       if k in ("input_ids", "labels")} for i in range(0, len(mine), mbs)])
    return cfg, device, model, steps, world


def _optimizer(cfg, model):
    import torch

    from trainer.run.optim import implementation_kwargs

    o = cfg.optim
    decay = [p for p in model.parameters() if p.dim() >= 2]  # weight decay on matrices only, as the trainer does
    rest = [p for p in model.parameters() if p.dim() < 2]
    kernel = implementation_kwargs(o.implementation, decay + rest, o.name)
    return torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                             **kernel)


def _ce_sum(model, batch, amp, device):
    import torch
    import torch.nn.functional as F

    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                           reduction="sum")


def _timed(steps, max_steps, one_step, device) -> list:
    import torch

    ends = []
    for k in range(max_steps):
        one_step(steps[k % len(steps)])
        if device.type == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    return ends


def bare_torch(spec, wrap: str) -> list:
    """single / ddp / fsdp: forward -> CE sum x dp / target tokens -> backward per micro-batch (DDP's reduction
    on the last one only), clip, AdamW step, zero_grad."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg, device, model, steps, world = _setup(spec)
    model.to(device)
    if wrap == "ddp":
        model = DDP(model, bucket_cap_mb=cfg.strategy.bucket_cap_mb,
                    gradient_as_bucket_view=cfg.strategy.gradient_as_bucket_view)
    elif wrap == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=cfg.strategy.reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=cfg.strategy.reshard_after_forward)
    opt = _optimizer(cfg, model)
    amp = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision.name]
    scale = world / (cfg.train.global_batch_size * cfg.data.seq_len)

    def one_step(micro_batches):
        for i, batch in enumerate(micro_batches):
            sync = model.no_sync() if wrap == "ddp" and i < len(micro_batches) - 1 else contextlib.nullcontext()
            with sync:
                (_ce_sum(model, batch, amp, device) * scale).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed(steps, cfg.train.max_steps, one_step, device)


def bare_deepspeed(spec) -> list:
    """ZeRO-2 / ZeRO-3: the engine Tessera configures (its DeepSpeed config), driven by engine.backward and
    engine.step per micro-batch (the engine clips and steps at the accumulation boundary)."""
    import deepspeed

    from trainer.strategies.deepspeed import build_ds_config

    cfg, device, model, steps, world = _setup(spec)
    ds_config, _ = build_ds_config(cfg, world)
    engine, _, _, _ = deepspeed.initialize(model=model.to(device), optimizer=_optimizer(cfg, model), config=ds_config)
    scale = world / (cfg.train.global_batch_size * cfg.data.seq_len)

    def one_step(micro_batches):
        for batch in micro_batches:
            engine.backward(_ce_sum(engine, batch, None, device) * scale, scale_wrt_gas=False)
            engine.step()

    return _timed(steps, cfg.train.max_steps, one_step, device)


def worker(path: str) -> int:
    import torch.distributed as dist

    spec = json.load(open(path))
    row = spec["row"]
    ends = bare_deepspeed(spec) if row.startswith("zero") else bare_torch(spec, row)
    if dist.get_rank() == 0:
        spec["step_ends"] = ends
        json.dump(spec, open(path, "w"))
    dist.destroy_process_group()
    return 0


# ---- measuring ---------------------------------------------------------------------------------------------------
def nproc_of(row: str, a) -> int:
    return 1 if row == "single" else a.nproc


def measure(a, row: str, side: str, work: str, tag: str) -> float:
    """Seconds per step after the warm-up, of Tessera's run or the bare loop's."""
    overrides = [*C.shape_overrides(a), f"strategy={row}"]
    env = C.thread_env(a.threads)
    n = nproc_of(row, a)
    if side == "tessera":
        run = C.run_trainer(overrides, n, os.path.join(work, tag), env, a.timeout)
        return a.global_batch * a.seq_len / C.tokens_per_s(run["metrics"], a.warmup)
    spec_path = os.path.join(work, tag + ".json")
    json.dump({"overrides": overrides, "threads": a.threads, "row": row}, open(spec_path, "w"))
    from trainer.launch.choose import run_process_group
    from trainer.parallel.dims import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", f"--master_port={free_port()}",
           os.path.abspath(__file__), "--worker", spec_path]
    done = run_process_group(cmd, env=env, timeout=a.timeout)
    if done.returncode != 0:
        raise C.RunFailed(f"bare {row} loop: exit {done.returncode}: {done.stderr.strip()[-1500:]}")
    ends = json.load(open(spec_path))["step_ends"]
    return (ends[-1] - ends[a.warmup - 1]) / (len(ends) - a.warmup)


def summary(times: list) -> dict:
    return {"median": statistics.median(times), "low": min(times), "high": max(times), "runs": times}


def row_result(a, row: str, work: str) -> dict:
    """Alternating repeats of both sides of one row -> tokens/s, ratio and overhead, each with its range."""
    times = {"tessera": [], "bare": []}
    for i in range(a.repeats):
        for side in (("tessera", "bare") if i % 2 == 0 else ("bare", "tessera")):
            times[side].append(measure(a, row, side, work, f"{row}-{side}{i}"))
            print(f"{row:7s} repeat {i + 1} {side:8s} {1000 * times[side][-1]:9.1f} ms/step", flush=True)
    tokens = a.global_batch * a.seq_len
    ratios = [b / t for t, b in zip(times["tessera"], times["bare"])]  # pairs from the same repeat
    overheads = [1000 * (t - b) for t, b in zip(times["tessera"], times["bare"])]
    return {"row": row, "nproc": nproc_of(row, a),
            "tokens_per_s": {s: summary([tokens / x for x in v]) for s, v in times.items()},
            "ms_per_step": {s: summary([1000 * x for x in v]) for s, v in times.items()},
            "ratio": summary(ratios), "overhead_ms": summary(overheads)}


def report(results: list) -> None:
    def rng(s, fmt):
        return f"{fmt.format(s['median'])} [{fmt.format(s['low'])}, {fmt.format(s['high'])}]"

    print("\n" + C.markdown_table(
        ["row", "ranks", "Tessera tokens/s", "bare loop tokens/s", "Tessera / bare", "overhead ms/step"],
        [[r["row"], r["nproc"], rng(r["tokens_per_s"]["tessera"], "{:.0f}"), rng(r["tokens_per_s"]["bare"], "{:.0f}"),
          rng(r["ratio"], "{:.3f}"), rng(r["overhead_ms"], "{:+.1f}")] for r in results]))
    print("\nmedian [lowest, highest] over the repeats; ratio and overhead per repeat pair (Tessera and the bare loop "
          "measured back to back)")


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:  # one rank of a bare loop
        return worker(sys.argv[2])
    ap = C.shape_parser(__doc__, FULL, QUICK)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)} (default all)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the distributed rows (default 2)")
    ap.add_argument("--repeats", type=int, help="measurements per side, alternating (default 4; --quick 1)")
    a = C.finish_shape(ap, ap.parse_args(argv))
    rows = [r for r in a.rows.split(",") if r]
    if not rows or set(rows) - set(ROWS):
        ap.error(f"--rows takes a comma list of {', '.join(ROWS)}")
    a.repeats = a.repeats or (1 if a.quick else 4)
    work = tempfile.mkdtemp(prefix="tessera-backends-")
    try:
        results = [row_result(a, row, work) for row in rows]
    except C.RunFailed as e:
        C.fail("bench_backends", str(e))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results)
    C.write_json(a.out, {"config": {k: getattr(a, k) for k in (*FULL, "threads", "repeats", "nproc", "set")},
                         "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
