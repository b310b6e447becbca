#!/usr/bin/env python
"""Tessera against the Hugging Face Trainer (accelerate; DeepSpeed for the ZeRO rows) on the same model, data,
batch, precision and steps: tokens/s side by side and the ratio, for single, ddp, zero2 and zero3.

    python benchmarks/bench_peers.py                                  # llama_100m, bf16, N = 2
    python benchmarks/bench_peers.py --rows single,ddp --world-size 4 --out /tmp/peers.json
    python benchmarks/bench_peers.py --quick                          # a debug-size model: the smoke test's size

Per row, one Tessera run and one HF Trainer run, back to back (with --repeats > 1 the order alternates, so that
drift in machine load hits both alike):

* Tessera: `trainer/main.py strategy=<row>` through the launcher launch.sh picks (python, torchrun, deepspeed),
  every rank through bench_collectives' probe (which also counts the collectives' bytes).
* HF: this file in worker mode (`--hf-worker`), through `python` (single) or `torchrun` (the rest). It composes
  the same Hydra config as the Tessera run and builds from it: the model from models.registry (the same config
  and the same seeded initial weights), the training sequences from trainer.data.datasets.build_data (the same
  packed sequences of data.seq_len tokens; each item gives `input_ids` and `labels` already shifted, passed as
  `labels` + `shift_labels`, so HF's loss takes the same seq_len targets per sequence without its own shift),
  TrainingArguments with per_device_train_batch_size = micro-batch, gradient_accumulation_steps = global batch /
  (micro-batch x N), max_steps, bf16 (autocast) or fp32, AdamW with the same lr / betas / eps / weight decay
  (`--hf-optim match`, the default: `adamw_torch_fused` where Tessera's `optim.implementation` takes torch's
  fused kernel, as it does by default on CPU and CUDA, else `adamw_torch`: the same torch.optim.AdamW kernel on
  both sides; HF's own default is `adamw_torch_fused`), the same max_grad_norm, a constant lr, logging every step
  as Tessera does; ddp via torchrun (DistributedDataParallel with Tessera's bucket size), ZeRO rows with
  `deepspeed=<the DeepSpeed config Tessera generates for the row>` (trainer.strategies.deepspeed.build_ds_config:
  the same ZeRO stage, buckets, overlap, precision, clipping; no optimizer section, so HF hands its torch AdamW to
  DeepSpeed as Tessera does).
* tokens/s on both sides: target tokens of a step after --warmup over its wall time, step end to step end
  (Tessera: the metrics.jsonl windows, one per step; HF: a TrainerCallback's on_step_end times).
* The row's figure per side is the median step's tokens/s over the measured steps of all its repeats (a stall of
  the machine moves one step, not the figure); the ratio is Tessera's over HF's, with a 95% bootstrap interval
  (runs resampled, then steps within them) and a verdict on the target: "met" (interval >= 1), "not met"
  (interval < 1) or "within noise". Each run's own tokens/s (its steps' tokens over their summed time) and each
  back-to-back pair's ratio are kept too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_collectives as BC  # noqa: E402

ROWS = ("single", "ddp", "zero2", "zero3")
# Three alternating repeats of 10 measured steps: one run's tokens/s on a shared 2-core machine moves by +-10%.
DEFAULTS = dict(model="llama_100m", precision="bf16", rows="single,ddp,zero2,zero3", world_size=2, seq_len=64,
                global_batch=4, micro_batch=1, warmup=3, steps=10, repeats=3)
QUICK = dict(model="tiny", precision="bf16", rows="single,ddp,zero2,zero3", world_size=2, seq_len=32,
             global_batch=4, micro_batch=1, warmup=3, steps=10, repeats=1)


# ================================================================================================================
# HF Trainer worker
# ================================================================================================================
def hf_worker(spec_path: str) -> None:
    with open(spec_path) as fh:
        spec = json.load(fh)
    run_dir = spec["run_dir"]
    probe = BC.install_probe(os.path.join(run_dir, "probe"))  # before torch.distributed is used
    if spec.get("t0"):
        probe.times["launch"] = spec["t0"]
    sys.path.insert(0, ROOT)
    import torch
    import transformers
    from hydra import compose, initialize_config_dir
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from models import registry
    from trainer.cli import register_resolvers
    from trainer.config import register_configs, to_object
    from trainer.data.datasets import build_data

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(spec["threads"])
    register_resolvers()
    register_configs()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        cfg = to_object(compose(config_name="config", overrides=[f"strategy={spec['row']}", *spec["overrides"]]))
    t, o = cfg.train, cfg.optim
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    probe.times["prepare_start"] = time.time()
    tokenizer = registry.load_tokenizer(cfg.model)
    info = registry.describe(cfg.model, tokenizer)
    train = build_data(cfg, tokenizer, info.vocab_size, log=lambda m: None).train

    class Sequences(torch.utils.data.Dataset):
        def __len__(self):
            return len(train)

        def __getitem__(self, i):
            d = train.get([i])
            y = d["labels"][0]
            return {"input_ids": d["input_ids"][0], "labels": y, "shift_labels": y}

    probe.times["build_start"] = time.time()
    model = registry.build(cfg.model, info, t.seed)
    num_params = sum(p.numel() for p in model.parameters())
    hf_optim = spec["hf_optim"]
    if hf_optim == "match":  # the kernel Tessera's build_optimizer picks for these parameters
        from trainer.optim import implementation_kwargs

        fused = implementation_kwargs(cfg.optim.implementation, list(model.parameters()), cfg.optim.name).get("fused")
        hf_optim = "adamw_torch_fused" if fused else "adamw_torch"
    accum = t.global_batch_size // (t.micro_batch_size * world)
    ds_config = None
    if spec["row"].startswith("zero"):
        from trainer.strategies.deepspeed import build_ds_config

        ds_config, problems = build_ds_config(cfg, world)
        if problems:
            raise SystemExit("; ".join(problems))
    cpu = not torch.cuda.is_available()
    use_cpu = cpu and ds_config is None
    accelerator_config = None
    if cpu and ds_config is not None:
        # DeepSpeed on CPU through the HF Trainer: TrainingArguments(use_cpu=True) makes accelerate run MULTI_CPU
        # and silently drops DeepSpeed; without it, accelerate finds no device backend for the CPU and counts one
        # process, so HF's batch arithmetic disagrees with DeepSpeed's. So the state is set up here, as accelerate
        # would on a GPU, with gloo (DeepSpeed's CPU accelerator), and the Trainer uses it.
        from datetime import timedelta

        from accelerate import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo", timeout=timedelta(seconds=1800))
        accelerator_config = {"use_configured_state": True}
    args = TrainingArguments(
        output_dir=os.path.join(run_dir, "hf-out"), max_steps=t.max_steps,
        per_device_train_batch_size=t.micro_batch_size, gradient_accumulation_steps=accum,
        learning_rate=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
        adam_epsilon=o.eps, max_grad_norm=t.grad_clip if t.grad_clip > 0 else 0.0, optim=hf_optim,
        lr_scheduler_type="constant", warmup_steps=0, bf16=cfg.precision.name == "bf16",
        fp16=cfg.precision.name == "fp16", logging_steps=t.log_every, logging_strategy="steps",
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, seed=t.seed,
        dataloader_num_workers=0, dataloader_drop_last=True, remove_unused_columns=False, use_cpu=use_cpu,
        ddp_backend="gloo" if cpu and world > 1 and ds_config is None else None,
        ddp_bucket_cap_mb=int(cfg.strategy.bucket_cap_mb),
        ddp_find_unused_parameters=False, deepspeed=ds_config, skip_memory_metrics=True,
        accelerator_config=accelerator_config,
        log_level="error")

    times = []

    class Timing(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            probe.times["build_end"] = time.time()
            if ds_config is not None and torch.distributed.is_initialized():
                # DeepSpeed's CPU all-reduce leaves a ~66 MB /dev/shm file per rank behind (see the strategy).
                from trainer.strategies.deepspeed import unlink_shared_memory_buffer

                unlink_shared_memory_buffer()

        def on_step_begin(self, args, state, control, **kw):
            probe.mark(state.global_step + 1, "step")

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(now)
            probe.mark(state.global_step, "between")
            if "first_step_end" not in probe.times:
                probe.times["first_step_end"] = time.time()

    losses = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    trainer = Trainer(model=model, args=args, train_dataset=Sequences(), callbacks=[Timing(), Losses()])
    trainer.train()
    stack = {"deepspeed_enabled": bool(getattr(trainer, "is_deepspeed_enabled", False)),
             "distributed_type": str(getattr(trainer.accelerator, "distributed_type", None)),
             "num_processes": getattr(trainer.accelerator, "num_processes", None),
             "wrapped_model": type(trainer.model_wrapped).__name__}
    warm = spec["warmup"]
    tokens_per_step = t.global_batch_size * cfg.data.seq_len
    step_times = [b - a for a, b in zip(times[warm - 1:], times[warm:])] if warm >= 1 else []
    seconds = sum(step_times)
    if rank == 0:
        with open(os.path.join(run_dir, "hf_result.json"), "w") as fh:
            json.dump({"tokens_per_s": tokens_per_step * len(step_times) / seconds if seconds > 0 else 0.0,
                       "tokens": tokens_per_step * len(step_times), "seconds": seconds,
                       "step_times_s": step_times, "step_tokens": [tokens_per_step] * len(step_times),
                       "measured_steps": len(step_times), "num_params": num_params,
                       "losses": losses, "transformers": transformers.__version__, "stack": stack,
                       "optim": hf_optim, "deepspeed_config": ds_config,
                       "accelerate": _version("accelerate"), "deepspeed": _version("deepspeed")}, fh)
    # The Trainer leaves the process group up; a gloo group torn down at interpreter exit can abort a rank
    # ("terminate called without an active exception"), so close it here, together.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _version(name):
    try:
        return __import__(name).__version__
    except Exception:  # noqa: BLE001
        return None


# ================================================================================================================
# Orchestration
# ================================================================================================================
def row_world(row: str, n: int) -> int:
    return 1 if row == "single" else n


def run_hf(row: str, n: int, overrides, work: str, tag: str, threads: int, warmup: int, hf_optim: str,
           timeout: float, log_dir=None) -> dict:
    run_dir = os.path.join(work, tag)
    os.makedirs(run_dir, exist_ok=True)
    spec_path = os.path.join(run_dir, "spec.json")
    t0 = time.time()
    with open(spec_path, "w") as fh:
        json.dump({"row": row, "overrides": overrides, "run_dir": run_dir, "threads": threads, "warmup": warmup,
                   "hf_optim": hf_optim, "t0": t0}, fh)
    script = [os.path.abspath(__file__), "--hf-worker", spec_path]
    cmd = BC.launch_cmd(script, "python" if n == 1 else "torchrun", n)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    log_path = os.path.join(log_dir or work, f"{tag}.log")
    rc, wall = BC.run_logged(cmd, env, log_path, timeout)
    out = {"side": "hf", "row": row, "world_size": n, "run_dir": run_dir, "log": log_path, "returncode": rc,
           "wall_s": wall, "command": " ".join(cmd)}
    if rc != 0:
        out["error"] = BC._failure_line(log_path, rc)
        return out
    with open(os.path.join(run_dir, "hf_result.json")) as fh:
        out.update(json.load(fh))
    out["collective_bytes_per_step"] = step_bytes(run_dir, warmup + 1)
    return out


def step_bytes(run_dir: str, step: int):
    """Collective volume (the paper's unit, bytes) of one step, the rank that moved most (bench_collectives)."""
    ranks = BC.read_probe(run_dir)
    if not ranks:
        return None
    return max(BC.step_volume(p["records"], step)["volume_bytes"] for p in ranks)


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def run_tessera_side(row: str, n: int, overrides, work: str, tag: str, threads: int, warmup: int,
                     timeout: float, log_dir=None) -> dict:
    r = BC.run_tessera(row, n, overrides, work, tag, threads, timeout, log_dir=log_dir)
    out = {"side": "tessera", "row": row, "world_size": n, "run_dir": r["run_dir"], "log": r["log"],
           "returncode": r["returncode"], "wall_s": r["wall_s"], "command": r["command"]}
    if "error" in r:
        out["error"] = r["error"]
        return out
    out.update(BC.window_throughput(r["metrics"], warmup))
    out["losses"] = [m["loss"] for m in r["metrics"]]
    out["collective_bytes_per_step"] = step_bytes(r["run_dir"], warmup + 1)
    return out


def row_precision(row: str, precision: str) -> tuple:
    """(precision, note): the HF Trainer refuses bf16 on a machine without a bf16 GPU unless use_cpu=True, and
    use_cpu=True drops DeepSpeed; so on CPU the ZeRO rows run in fp32, on both sides."""
    if row.startswith("zero") and precision == "bf16" and not _cuda():
        return "fp32", ("fp32 on both sides: on CPU, TrainingArguments refuses bf16 unless use_cpu=True, which "
                        "turns DeepSpeed off")
    return precision, ""


def measure(rows, n, model, precision, seq_len, global_batch, micro_batch, warmup, steps, repeats, quick,
            threads, work, timeout, hf_optim="match", extra=(), log=print, log_dir=None) -> list:
    """One comparison row per entry of `rows`: Tessera and HF back to back (the order alternating per repeat)."""
    results = []
    for row in rows:
        w = row_world(row, n)
        prec, note = row_precision(row, precision)
        ov = BC.run_overrides(model, prec, seq_len, global_batch, micro_batch, warmup + steps, quick, extra)
        th = threads or max(1, (os.cpu_count() or 1) // w)
        sides = {"tessera": [], "hf": []}
        for i in range(repeats):
            order = ("tessera", "hf") if i % 2 == 0 else ("hf", "tessera")
            for side in order:
                if side == "tessera":
                    r = run_tessera_side(row, w, ov, work, f"peer-tessera-{row}-{i}", th, warmup, timeout,
                                         log_dir)
                else:
                    r = run_hf(row, w, ov, work, f"peer-hf-{row}-{i}", th, warmup, hf_optim, timeout, log_dir)
                sides[side].append(r)
                msg = r.get("error") or f"{r['tokens_per_s']:.1f} tok/s"
                log(f"  {row:6s} N={w} {side:7s} {msg}  ({r['wall_s']:.0f} s)")
        ok = {k: [r for r in v if "error" not in r] for k, v in sides.items()}
        tess, hf = (median_step_rate(ok[k]) if ok[k] else None for k in ("tessera", "hf"))
        interval = bootstrap_ratio(ok["tessera"], ok["hf"]) if tess and hf else None
        errors = {k: v[0]["error"] for k, v in sides.items() if v and "error" in v[0]}
        vol = {k: (v[0].get("collective_bytes_per_step") if v else None) for k, v in ok.items()}
        # Each repeat's back-to-back pair, as a ratio: their spread shows how far the machine's noise reaches.
        pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(sides["tessera"], sides["hf"])
                 if "error" not in a and "error" not in b and b["tokens_per_s"]]
        results.append({"row": row, "world_size": w, "threads": th, "precision": prec, "note": note,
                        "tessera_tokens_per_s": tess, "hf_tokens_per_s": hf,
                        "ratio": tess / hf if tess and hf else None, "ratio_interval": interval,
                        "verdict": verdict(interval), "pair_ratios": pairs, "errors": errors,
                        "run_tokens_per_s": {k: [r["tokens_per_s"] for r in v] for k, v in ok.items()},
                        "collective_bytes_per_step": vol, "runs": sides, "overrides": ov})
    return results


# ---- statistics: a shared 2-core machine stalls single steps (1.5-2x) and drifts between runs (+-15%) -----------
def step_rates(run: dict) -> list:
    """tokens/s of each measured step (window) of one run."""
    return [t / s for t, s in zip(run["step_tokens"], run["step_times_s"]) if s > 0]


def median_step_rate(runs) -> float:
    """tokens/s of the median step, over the measured steps of all repeats of one side: a stall of the machine
    moves one step, not the figure."""
    return statistics.median(x for r in runs for x in step_rates(r))


def bootstrap_ratio(tessera_runs, hf_runs, draws: int = 2000, level: float = 0.95, seed: int = 0):
    """[lo, hi] of Tessera / HF (median step rates) over resamples of both sides: the runs with replacement, then
    the steps within each drawn run, so that drift between runs widens the interval as much as it moves the
    ratio."""
    import random

    rng = random.Random(seed)
    sides = [[step_rates(r) for r in runs] for runs in (tessera_runs, hf_runs)]

    def resampled_median(runs):
        pooled = []
        for run in rng.choices(runs, k=len(runs)):
            pooled += rng.choices(run, k=len(run))
        return statistics.median(pooled)

    ratios = sorted(resampled_median(sides[0]) / resampled_median(sides[1]) for _ in range(draws))
    tail = (1.0 - level) / 2
    return [ratios[int(tail * (draws - 1))], ratios[int((1.0 - tail) * (draws - 1))]]


def verdict(interval) -> str:
    """Against the target (Tessera at least as fast): 'met' when the whole interval is >= 1, 'not met' when it is
    below 1, else 'within noise' (the measurement cannot tell the two apart)."""
    if not interval:
        return "—"
    lo, hi = interval
    return "met" if lo >= 1.0 else "not met" if hi < 1.0 else "within noise"


def fmtv(v) -> str:
    return f"{v:.1f}" if v else "—"


def table(results) -> str:
    out = ["| row | N | precision | Tessera tok/s | HF Trainer tok/s | Tessera / HF | 95% interval | target | per "
           "repeat | collectives / step MiB (Tessera / HF) | HF stack | notes |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        hf_runs = [x for x in r["runs"]["hf"] if "error" not in x]
        stack = "accelerate" + (" + DeepSpeed" if r["row"].startswith("zero") else "")
        if hf_runs and hf_runs[0].get("stack"):
            stack += f": {hf_runs[0]['stack']['wrapped_model']}"
        notes = "; ".join(f"{k} failed: {v}" for k, v in r["errors"].items())
        if r.get("note"):
            notes = (notes + "; " if notes else "") + r["note"]
        if r["row"] == "ddp":
            notes = (notes + "; " if notes else "") + ("HF's DDP reduces in DDP's built-in C++ hook, which no "
                                                        "torch.distributed call shows: its bytes are not counted")
        vol = r.get("collective_bytes_per_step") or {}
        vtxt = " / ".join(f"{vol[k] / 2**20:.2f}" if vol.get(k) is not None else "—" for k in ("tessera", "hf"))
        ratio = f"**{r['ratio']:.3f}**" if r["ratio"] else "—"
        pairs = ", ".join(f"{x:.3f}" for x in r.get("pair_ratios") or []) or "—"
        interval = "{:.3f}-{:.3f}".format(*r["ratio_interval"]) if r.get("ratio_interval") else "—"
        out.append(f"| {r['row']} | {r['world_size']} | {r.get('precision', '')} | {fmtv(r['tessera_tokens_per_s'])} | "
                   f"{fmtv(r['hf_tokens_per_s'])} | {ratio} | {interval} | {r.get('verdict', '—')} | {pairs} | "
                   f"{vtxt} | {stack} | {notes} |")
    return "\n".join(out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=f"preset in conf/model (default {DEFAULTS['model']})")
    ap.add_argument("--precision", choices=("fp32", "bf16"), help="default bf16")
    ap.add_argument("--rows", help=f"comma-separated, of {', '.join(ROWS)} (default all)")
    ap.add_argument("--world-size", type=int, help="ranks of the ddp / zero rows (default 2; single is 1)")
    ap.add_argument("--seq-len", type=int, help=f"default {DEFAULTS['seq_len']}")
    ap.add_argument("--global-batch", type=int, help=f"sequences per optimizer step (default "
                                                     f"{DEFAULTS['global_batch']})")
    ap.add_argument("--micro-batch", type=int, help="sequences per rank per forward (default 1)")
    ap.add_argument("--warmup", type=int, help=f"steps not measured (default {DEFAULTS['warmup']})")
    ap.add_argument("--steps", type=int, help=f"measured steps (default {DEFAULTS['steps']})")
    ap.add_argument("--repeats", type=int, help=f"runs per side, order alternating (default {DEFAULTS['repeats']})")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS per rank (default: CPU count / ranks)")
    ap.add_argument("--hf-optim", default="match",
                    help="TrainingArguments.optim (default match: adamw_torch_fused where Tessera runs torch's fused "
                         "AdamW kernel, else adamw_torch)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra Hydra override")
    ap.add_argument("--quick", action="store_true", help="debug-size model, 3 warm-up + 10 measured steps")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run (default 1800)")
    a = ap.parse_args(argv)
    base = QUICK if a.quick else DEFAULTS
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    bad = [r for r in a.rows.split(",") if r not in ROWS]
    if bad:
        ap.error(f"--rows: unknown {bad}; of {', '.join(ROWS)}")
    if a.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step holds the start-up)")
    for w in {1, a.world_size}:
        if a.global_batch % (a.micro_batch * w):
            ap.error(f"--global-batch {a.global_batch} must divide by micro-batch x {w}")
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--hf-worker" in argv:
        hf_worker(argv[argv.index("--hf-worker") + 1])
        return 0
    a = parse_args(argv)
    rows = a.rows.split(",")
    print(f"model {a.model}{' (debug size)' if a.quick else ''} | {a.precision} | seq_len {a.seq_len} | global batch "
          f"{a.global_batch}, micro {a.micro_batch} | {a.warmup} warm-up + {a.steps} measured steps | "
          f"N = {a.world_size}", flush=True)
    BC.run_and_report(a, "tessera-peers-", table, lambda work: measure(
        rows, a.world_size, a.model, a.precision, a.seq_len, a.global_batch, a.micro_batch, a.warmup, a.steps,
        a.repeats, a.quick, a.threads, work, a.timeout, a.hf_optim, a.set, log=lambda m: print(m, flush=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
