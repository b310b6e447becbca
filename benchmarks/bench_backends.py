#!/usr/bin/env python
"""Each backend against its own limit: Tessera's tokens/s per strategy next to a bare loop on the same engine, model,
data, global batch, sequence and precision (plain DDP, a bare DeepSpeed engine loop for ZeRO-2 and ZeRO-3, a bare
FSDP2 `fully_shard` loop, a bare single-process loop) and next to the Hugging Face Trainer with its own integration
of that engine, with intervals over alternating repeats, and Tessera's per-step overhead in milliseconds (its step
time less the bare loop's: the host work around the same math).

    python benchmarks/bench_backends.py                           # tiny preset, fp32, 2 ranks, 4 repeats
    python benchmarks/bench_backends.py --rows zero2,zero3 --repeats 6 --out /tmp/backends.json
    python benchmarks/bench_backends.py --quick --against hf      # debug-size model, 1 repeat, HF side only
    python benchmarks/bench_backends.py --gpu 1b                  # a GPU machine: ~1B Llama, bf16, every row + MFU
    python benchmarks/bench_backends.py --gpu 1b --dry-run        # the plan and Tessera's commands; runs nothing

The HF side (`--against hf`; default bare,hf) runs transformers.Trainer under torchrun like the bare loops, with
the same model, sequences, micro batch, accumulation, AdamW hyper-parameters and kernel, clipping, precision and
steps (benchmarks/common.py hf_train): single and ddp are its own loop (DDP with strategy=ddp's bucket size and
find_unused_parameters); zero2 / zero3 pass Tessera's DeepSpeed config (build_ds_config) as
`TrainingArguments(deepspeed=...)`; fsdp asks for FSDP2 (`fsdp_config` version 2, each decoder layer wrapped). On
CPU the fsdp row's HF side is not run: accelerate enables FSDP (version 1 or 2) only on accelerator devices and
would train plain DDP instead, so the row lists it under not_run with the reason.

Repeats rotate the order of the sides (Tessera, bare, HF; bare, HF, Tessera; ...) so that slow drift of the machine
hits all; each figure is the median with the lowest and highest run, ratios are per repeat. See
benchmarks/README.md.
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
from bench_gpu import SIZES, size_overrides  # noqa: E402
from trainer.launch import ds_ops  # noqa: E402

FULL = dict(model="tiny", precision="fp32", seq_len=256, global_batch=8, micro_batch=2, warmup=5, steps=30)
QUICK = dict(model="tiny", precision="fp32", seq_len=32, global_batch=4, micro_batch=1, warmup=2, steps=4)
ROWS = ("single", "ddp", "zero2", "zero3", "fsdp")
# --gpu <size>: bench_gpu.py's Llama shape in bf16 at 2048 tokens, 4 sequences per GPU per forward, 2 micro-batches
# per step on each rank of the distributed rows (global batch 8 x GPUs)
GPU = dict(precision="bf16", seq_len=2048, micro_batch=4, warmup=3, steps=10)


# ---- the bare loops and the HF Trainer (one process per rank, started by torchrun) ---------------------------------
def _process_group(device) -> None:
    """NCCL on a GPU, else gloo; the HF side's accelerate and DeepSpeed join this group instead of making theirs."""
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def _setup(spec):
    """Process group, config, model and this rank's micro-batches of a few global batches, built as the trainer
    builds them (the same seed, the same sequences)."""
    import torch.distributed as dist

    from trainer.data.sampler import rank_slice

    cfg, model, train = C.build_model_and_data(spec)
    device = C.train_device(cfg)
    _process_group(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mbs = cfg.train.micro_batch_size
    steps = []
    for indices in C.global_batch_indices(cfg, train):
        mine = rank_slice(indices, rank, world)
        steps.append([{k: v.to(device) for k, v in train.get(mine[i:i + mbs]).items()
                       if k in ("input_ids", "labels")} for i in range(0, len(mine), mbs)])
    return cfg, device, model, steps, world


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
    opt = C.adamw(cfg, model)
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
    engine, _, _, _ = deepspeed.initialize(model=model.to(device), optimizer=C.adamw(cfg, model), config=ds_config)
    scale = world / (cfg.train.global_batch_size * cfg.data.seq_len)

    def one_step(micro_batches):
        for batch in micro_batches:
            engine.backward(_ce_sum(engine, batch, None, device) * scale, scale_wrt_gas=False)
            engine.step()

    return _timed(steps, cfg.train.max_steps, one_step, device)


class NotRun(Exception):
    """A side that cannot run a row on this machine; the message says why."""


def hf_side(spec) -> list:
    """The Hugging Face Trainer on this row (common.hf_train: same model, sequences, batch shape, AdamW, clipping,
    precision and steps), with the row's distributed settings (_hf_args). NotRun where HF would not use the
    row's engine (FSDP on CPU: accelerate ignores fsdp_config there and would train plain DDP)."""
    import torch.distributed as dist

    cfg, model, train = C.build_model_and_data(spec)
    _process_group(C.train_device(cfg))
    row, world = spec["row"], dist.get_world_size()

    def check(trainer):
        state = trainer.accelerator.state
        engine = {"zero2": trainer.is_deepspeed_enabled, "zero3": trainer.is_deepspeed_enabled,
                  "fsdp": trainer.is_fsdp_enabled and state.is_fsdp2}.get(row, True)
        if not engine or state.num_processes != world:
            why = " (accelerate turns FSDP on for accelerator devices only; fsdp_config is ignored and it would " \
                  "train plain DDP)" if row == "fsdp" and state.device.type == "cpu" else ""
            raise NotRun(f"HF Trainer: accelerate sets this run up as {state.distributed_type.value} on "
                         f"{state.num_processes} process(es), not {row} on {world}{why}")

    extra = _hf_args(cfg, row, world, type(model.model.layers[0]).__name__)
    return C.hf_train(cfg, model, train, spec["work"], check=check, **extra)


def _hf_args(cfg, row: str, world: int, layer_class: str) -> dict:
    """TrainingArguments of a row: single none; ddp the DDP bucket size and find_unused_parameters of
    strategy=ddp (HF would turn find_unused_parameters on); zero2 / zero3 the DeepSpeed config Tessera builds;
    fsdp FSDP2 (accelerate's fully_shard) on every decoder layer and the root."""
    s = cfg.strategy
    if row == "ddp":
        return {"ddp_bucket_cap_mb": int(s.bucket_cap_mb), "ddp_find_unused_parameters": s.find_unused_parameters}
    if row.startswith("zero"):
        from trainer.strategies.deepspeed import build_ds_config

        ds, _ = build_ds_config(cfg, world)
        # Tessera's config with the keys HF checks against TrainingArguments set to "auto" (HF fills in the same
        # values): batch sizes, accumulation, clipping, bf16 / fp16 enabled. No optimizer section: HF's AdamW.
        ds.update({k: "auto" for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                       "gradient_accumulation_steps", "gradient_clipping")})
        ds["bf16"], ds["fp16"] = {**ds["bf16"], "enabled": "auto"}, {**ds["fp16"], "enabled": "auto"}
        return {"deepspeed": ds}
    if row == "fsdp":
        return {"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": s.reshard_after_forward,
                                              "transformer_layer_cls_to_wrap": [layer_class]}}
    return {}


def worker(path: str) -> int:
    import torch.distributed as dist

    spec = json.load(open(path))
    row = spec["row"]
    if row.startswith("zero"):  # DeepSpeed's ops from this venv's build folder, as Tessera's ranks load them
        ds_ops.ensure_ready()
    try:
        if spec["side"] == "hf":
            spec["step_ends"] = hf_side(spec)
        else:
            spec["step_ends"] = bare_deepspeed(spec) if row.startswith("zero") else bare_torch(spec, row)
    except NotRun as e:  # every rank finds the same
        spec["not_run"] = str(e)
    if int(os.environ.get("RANK", 0)) == 0:
        json.dump(spec, open(path, "w"))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


# ---- measuring ---------------------------------------------------------------------------------------------------
def nproc_of(row: str, a) -> int:
    return 1 if row == "single" else a.nproc


def measure(a, row: str, side: str, work: str, tag: str) -> float:
    """Seconds per step after the warm-up of one side: Tessera's run, the bare loop's or the HF Trainer's."""
    overrides = [*C.shape_overrides(a), f"strategy={row}"]
    env = C.thread_env(a.threads)
    n = nproc_of(row, a)
    if side == "tessera":
        run = C.run_trainer(overrides, n, os.path.join(work, tag), env, a.timeout)
        return a.global_batch * a.seq_len / C.tokens_per_s(run["metrics"], a.warmup)
    spec_path = os.path.join(work, tag + ".json")
    json.dump({"overrides": overrides, "threads": a.threads, "row": row, "side": side,
               "work": os.path.join(work, tag)}, open(spec_path, "w"))
    from trainer.launch.choose import run_process_group
    from trainer.parallel.dims import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", f"--master_port={free_port()}",
           os.path.abspath(__file__), "--worker", spec_path]
    done = run_process_group(cmd, env=env, timeout=a.timeout)
    if done.returncode != 0:
        raise C.RunFailed(f"{side} {row} loop: exit {done.returncode}: {done.stderr.strip()[-1500:]}")
    result = json.load(open(spec_path))
    if "not_run" in result:
        raise NotRun(result["not_run"])
    ends = result["step_ends"]
    if len(ends) != a.warmup + a.steps:
        raise C.RunFailed(f"{side} {row} loop: {len(ends)} optimizer steps, not {a.warmup + a.steps}")
    return (ends[-1] - ends[a.warmup - 1]) / (len(ends) - a.warmup)


def summary(times: list) -> dict:
    return {"median": statistics.median(times), "low": min(times), "high": max(times), "runs": times}


def row_result(a, row: str, work: str) -> dict:
    """Repeats of Tessera and the --against sides of one row, order rotated -> tokens/s, ratios (and the
    overhead against the bare loop), each with its range; a side that cannot run here is listed in not_run."""
    sides = ["tessera", *a.against]
    times, not_run = {s: [] for s in sides}, {}
    for i in range(a.repeats):
        for side in sides[i % len(sides):] + sides[:i % len(sides)]:  # rotated: slow drift hits every side
            if side in not_run:
                continue
            try:
                times[side].append(measure(a, row, side, work, f"{row}-{side}{i}"))
            except NotRun as e:
                not_run[side] = str(e)
                print(f"{row:7s} {side}: not run: {e}", flush=True)
                continue
            print(f"{row:7s} repeat {i + 1} {side:8s} {1000 * times[side][-1]:9.1f} ms/step", flush=True)
    times = {s: v for s, v in times.items() if s not in not_run}
    tokens = a.global_batch * a.seq_len
    out = {"row": row, "nproc": nproc_of(row, a),
           "tokens_per_s": {s: summary([tokens / x for x in v]) for s, v in times.items()},
           "ms_per_step": {s: summary([1000 * x for x in v]) for s, v in times.items()}}
    if "bare" in times:  # pairs from the same repeat
        out["ratio"] = summary([b / t for t, b in zip(times["tessera"], times["bare"])])
        out["overhead_ms"] = summary([1000 * (t - b) for t, b in zip(times["tessera"], times["bare"])])
    if "hf" in times:
        out["ratio_hf"] = summary([h / t for t, h in zip(times["tessera"], times["hf"])])
    if a.peak_tflops:  # model FLOPs utilisation of every side: all positions / s x FLOPs per token / peak
        per_s = a.flops_per_token * tokens / (a.peak_tflops * 1e12 * nproc_of(row, a))
        out["mfu"] = {s: summary([per_s / x for x in v]) for s, v in times.items()}
    if not_run:
        out["not_run"] = not_run
    return out


def report(results: list, against: list) -> None:
    def rng(r, side, key, fmt):
        if side in r.get("not_run", {}):
            return "not run"
        s = r[key] if key else r["tokens_per_s"][side]
        return f"{fmt.format(s['median'])} [{fmt.format(s['low'])}, {fmt.format(s['high'])}]"

    headers, cells = ["row", "ranks", "Tessera tokens/s"], []
    if "bare" in against:
        headers += ["bare loop tokens/s", "Tessera / bare", "overhead ms/step"]
    if "hf" in against:
        headers += ["HF Trainer tokens/s", "Tessera / HF"]
    if any("mfu" in r for r in results):
        headers += ["MFU " + " / ".join(("Tessera", *against))]
    for r in results:
        row = [r["row"], r["nproc"], rng(r, "tessera", None, "{:.0f}")]
        if "bare" in against:
            row += [rng(r, "bare", None, "{:.0f}"), rng(r, "bare", "ratio", "{:.3f}"),
                    rng(r, "bare", "overhead_ms", "{:+.1f}")]
        if "hf" in against:
            row += [rng(r, "hf", None, "{:.0f}"), rng(r, "hf", "ratio_hf", "{:.3f}")]
        if "mfu" in r:
            row += [" / ".join(f"{100 * r['mfu'][s]['median']:.1f}%" if s in r["mfu"] else "—"
                               for s in ("tessera", *against))]
        cells.append(row)
    print("\n" + C.markdown_table(headers, cells))
    print("\nmedian [lowest, highest] over the repeats; ratios and overhead per repeat (Tessera and the other side "
          "measured in the same round)")
    for r in results:
        for side, why in r.get("not_run", {}).items():
            print(f"{r['row']}: {side} not run: {why}")


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:  # one rank of a bare loop
        return worker(sys.argv[2])
    a = parse(argv)
    print(f"{a.model}{' ' + a.gpu if a.gpu else ''} | {a.precision} | seq_len {a.seq_len} | global batch "
          f"{a.global_batch}, micro-batch {a.micro_batch} | {a.warmup} warm-up + {a.steps} steps x {a.repeats} repeats"
          + (f" | {a.flops_per_token / 1e9:.2f} GFLOP per token, peak {a.peak_tflops} TFLOP/s" if a.peak_tflops
             else ""), flush=True)
    if a.dry_run:
        return dry_run(a)
    work = tempfile.mkdtemp(prefix="tessera-backends-")
    try:
        results = [row_result(a, row, work) for row in a.rows]
    except C.RunFailed as e:
        C.fail("bench_backends", str(e))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results, a.against)
    C.write_json(a.out, {"config": {k: getattr(a, k) for k in (*FULL, "threads", "repeats", "nproc", "against", "set",
                                                               "gpu", "peak_tflops", "flops_per_token")},
                         "rows": results})
    return 0


def parse(argv):
    ap = C.shape_parser(__doc__, FULL, QUICK)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)} (default all)")
    ap.add_argument("--nproc", type=int, help="ranks of the distributed rows (default 2; --gpu: every GPU)")
    ap.add_argument("--against", default="bare,hf", help="sides measured next to Tessera, comma list of bare, hf "
                                                            "(default both)")
    ap.add_argument("--repeats", type=int, help="measurements per side, order rotated (default 4; --quick 1)")
    ap.add_argument("--gpu", choices=sorted(SIZES), help="a GPU machine's run: this Llama shape (bench_gpu.py's), "
                                                        "bf16, seq 2048, micro-batch 4, 8 threads, MFU")
    ap.add_argument("--peak-tflops", type=float, help="dense peak per device for MFU (default: the GPU's known one)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and Tessera's commands; run nothing")
    a = ap.parse_args(argv)
    if a.gpu:
        gpus = _gpu_count()
        if not gpus and not a.dry_run:
            ap.error(f"--gpu {a.gpu} needs a CUDA device (none visible here); --dry-run prints its plan anywhere")
        a.nproc = a.nproc or max(gpus, 1)
        for key, value in {**GPU, "model": "llama_100m", "global_batch": 8 * a.nproc}.items():
            setattr(a, key, getattr(a, key) if getattr(a, key) is not None else value)
        a.threads = 8 if a.threads == 1 else a.threads
        a.set = [o for o in size_overrides(a.gpu, a.seq_len) if not o.startswith("model=")] + a.set
    a.nproc = a.nproc or 2
    a = C.finish_shape(ap, a)
    a.rows = [r for r in a.rows.split(",") if r]
    if not a.rows or set(a.rows) - set(ROWS):
        ap.error(f"--rows takes a comma list of {', '.join(ROWS)}")
    against = {s for s in a.against.split(",") if s}
    if not against or against - {"bare", "hf"}:
        ap.error("--against takes a comma list of bare, hf")
    a.against = [s for s in ("bare", "hf") if s in against]
    a.repeats = a.repeats or (1 if a.quick else 4)
    a.peak_tflops = a.peak_tflops or C.known_peak_tflops()
    a.flops_per_token = C.model_counts(C.shape_overrides(a), a.seq_len)["flops_per_token"] if a.peak_tflops else None
    return a


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def dry_run(a) -> int:
    from trainer.launch.choose import launcher_command, launcher_for

    print("commands of Tessera's side (--dry-run: nothing is run; the bare and HF sides run the same overrides "
          "under torch.distributed.run with this script's --worker):")
    for row in a.rows:
        overrides = [*C.shape_overrides(a), f"strategy={row}"]
        launcher = launcher_for(overrides)
        cmd = launcher_command("torchrun-quiet" if launcher == "torchrun" else launcher, nproc_of(row, a))
        print(f"# {row} ({nproc_of(row, a)} ranks; sides: tessera, {', '.join(a.against)})\n"
              + " ".join([*cmd, *overrides, f"hydra.run.dir=<work folder>/{row}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
