#!/usr/bin/env python
"""Bytes moved by collectives per training step, counted at the collective calls, next to the ZeRO paper's
communication volume (2Ψ for DDP and ZeRO-1/2, 3Ψ for ZeRO-3 and FSDP).

    python benchmarks/bench_collectives.py                                  # llama_100m; ddp, zero1/2/3, fsdp at N = 2
    python benchmarks/bench_collectives.py --strategies fsdp,zero3 --world-sizes 2,4 --out /tmp/coll.json
    python benchmarks/bench_collectives.py --quick                          # a debug-size model: seconds of compute

Every rank of a real training run (`trainer/main.py` under the same launcher launch.sh would pick) starts through
this file in probe mode (`bench_collectives.py --probe [--local_rank=N] <hydra overrides>`), which, before
anything else is imported:

* wraps the collective functions of `torch.distributed` (the same objects in `torch.distributed.distributed_c10d`):
  all_reduce, all_reduce_coalesced, reduce, broadcast, all_gather, all_gather_single / all_gather_into_tensor /
  _all_gather_base, all_gather_coalesced, reduce_scatter, reduce_scatter_single / reduce_scatter_tensor /
  _reduce_scatter_base, all_to_all(_single), gather, scatter, send / recv / isend / irecv, batch_isend_irecv,
  barrier, and the functional collectives DTensor uses (`torch.distributed._functional_collectives`: all_reduce,
  all_gather_tensor, reduce_scatter_tensor, all_to_all_single and their autograd variants). Only the outermost
  call counts (send() calls isend(); batch_isend_irecv calls isend/irecv): nothing is counted twice. The object
  collectives (all_gather_object, ...) are not counted themselves; the tensor collectives they issue are.
  DeepSpeed calls torch.distributed underneath (deepspeed.comm), FSDP2 calls all_gather_single /
  reduce_scatter_single, DDP's comm hook calls all_reduce, pipelining batch_isend_irecv / isend / irecv: what
  is counted is what was really called (on gloo, a fallback shows up as the call it falls back to).
* wraps `trainer.build.build` so that the built run's `strategy.forward_backward` and `strategy.optimizer_step`
  tag every call with the optimizer step (1, 2, ...) and phase; the loop's logging reduction (`dp_sum` of the
  loss, outside those two) is tagged "between" and not part of a step. DeepSpeed's engine steps inside
  forward_backward, so ZeRO's post-step parameter all-gather is in the step too.
* records timestamps (interpreter start, start of config checks, start and end of the build, end of the first
  optimizer step), this rank's peak memory (RSS on CPU, `max_memory_allocated` on CUDA), and writes
  `<run dir>/probe/rank<R>.json` at exit.

Conventions (per rank, one steady-state step: the last but one; "steady" = the last step moved the same bytes):

* "at the calls": the tensor bytes handed to each call: all-reduce: the tensor; reduce-scatter: its input (the
  full, unsplit tensor); all-gather: its output (the full tensor); broadcast / reduce / send / recv: the tensor.
* "volume" (the ZeRO paper's unit, sec. 7): an all-reduce counts twice (reduce-scatter + all-gather), every
  other collective once; the result is shown in units of Ψ elements, Ψ = the model's parameter count (elements,
  whatever their dtype), and in bytes. Theory: DDP, ZeRO-1, ZeRO-2: 2Ψ (gradients reduce-scattered or
  all-reduced, parameters all-gathered after the step); ZeRO-3, FSDP: 3Ψ (parameters all-gathered in forward and
  again in backward, gradients reduce-scattered); HSDP: 3Ψ in the shard group + 2Ψ/shard-size across replicas.
* "ring traffic": the bytes one rank sends with ring algorithms: (n-1)/n x volume for the collectives of a group
  of n ranks; broadcast / reduce / point-to-point: the tensor once.
"""
from __future__ import annotations

import argparse
import atexit
import functools
import inspect
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
MIB = 2**20

# Paper volume in Ψ per step, by strategy (None: no single figure).
THEORY = {"ddp": 2.0, "zero1": 2.0, "zero2": 2.0, "zero3": 3.0, "zero3_offload": 3.0, "fsdp": 3.0}
THEORY_TEXT = {"ddp": "2Ψ", "zero1": "2Ψ", "zero2": "2Ψ", "zero3": "3Ψ", "zero3_offload": "3Ψ", "fsdp": "3Ψ",
               "hsdp": "3Ψ + 2Ψ/s"}
ZERO = ("zero1", "zero2", "zero3", "zero3_offload")

# Run-shape overrides every benchmark launch shares (eval, export, checkpoints, progress, TensorBoard off).
QUIET = ["eval.every=0", "eval.at_start=false", "eval.at_end=false", "export.hf_at_end=false",
         "checkpoint.every=0", "checkpoint.at_end=false", "checkpoint.resume=none", "logging.progress=false",
         "logging.tensorboard=false", "scheduler=constant", "scheduler.warmup_steps=0"]
# --quick: the preset shrunk to a debug size.
QUICK_MODEL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
               "model.intermediate_size=128", "data.embedded_documents=400"]
# Degrees that make a strategy a real instance of itself at a world size (None: not run at that size).
STRATEGY_OVERRIDES = {
    "hsdp": lambda n: ["strategy.dp_shard=2"] if n >= 4 and n % 2 == 0 else None,
    "fsdp_tp": lambda n: ["strategy.tp=2"] if n >= 4 and n % 2 == 0 else None,
    "pp_fsdp": lambda n: ["strategy.pp=2"] if n >= 4 and n % 2 == 0 else None,
    "3d": lambda n: ["strategy.pp=2", "strategy.tp=2"] if n >= 4 and n % 4 == 0 else None,
    "tp": lambda n: [] if n >= 2 else None,
    "pp": lambda n: [] if n >= 2 else None,
    "single": lambda n: [] if n == 1 else None,
}
NOT_RUN_WHY = {
    "hsdp": "needs >= 2 shard groups of 2 ranks (N >= 4)",
    "fsdp_tp": "needs dp_shard >= 2 x tp 2 (N >= 4)",
    "pp_fsdp": "needs pp 2 x dp_shard >= 2 (N >= 4)",
    "3d": "needs pp 2 x tp 2 (N >= 4; at N = 4 its dp_shard is 1)",
    "tp": "needs >= 2 ranks", "pp": "needs >= 2 ranks", "single": "one process only",
}


def dp_degree(strategy: str, n: int) -> int:
    """Data-parallel ranks of `strategy` at world size n with the degrees of strategy_overrides."""
    return {"tp": 1, "pp": 1, "3d": max(1, n // 4), "fsdp_tp": max(1, n // 2), "pp_fsdp": max(1, n // 2)}.get(
        strategy, n)


def strategy_overrides(strategy: str, n: int):
    """Hydra overrides that make `strategy` a real instance at world size n, or None (not run there)."""
    fn = STRATEGY_OVERRIDES.get(strategy)
    return [] if fn is None else fn(n)


# ================================================================================================================
# Probe: counting inside every rank
# ================================================================================================================
# name -> (kind, names of the arguments that hold the counted tensors (lists are flattened))
C10D_OPS = {
    "all_reduce": ("all_reduce", ("tensor",)),
    "all_reduce_coalesced": ("all_reduce", ("tensors",)),
    "reduce": ("reduce", ("tensor",)),
    "broadcast": ("broadcast", ("tensor",)),
    "all_gather": ("all_gather", ("tensor_list",)),
    "all_gather_single": ("all_gather", ("output_tensor",)),
    "all_gather_into_tensor": ("all_gather", ("output_tensor",)),
    "_all_gather_base": ("all_gather", ("output_tensor",)),
    "all_gather_coalesced": ("all_gather", ("output_tensor_lists",)),
    "reduce_scatter": ("reduce_scatter", ("input_list",)),
    "reduce_scatter_single": ("reduce_scatter", ("input",)),
    "reduce_scatter_tensor": ("reduce_scatter", ("input",)),
    "_reduce_scatter_base": ("reduce_scatter", ("input",)),
    "all_to_all_single": ("all_to_all", ("input",)),
    "all_to_all": ("all_to_all", ("input_tensor_list",)),
    "gather": ("gather", ("tensor",)),
    "scatter": ("scatter", ("tensor",)),
    "send": ("send", ("tensor",)),
    "isend": ("send", ("tensor",)),
    "recv": ("recv", ("tensor",)),
    "irecv": ("recv", ("tensor",)),
    "batch_isend_irecv": ("p2p", ("p2p_op_list",)),
    "barrier": ("barrier", ()),
}
# Functional collectives (DTensor): the counted tensor is the input, or the result for an all-gather.
FUNCOL_OPS = {
    "all_reduce": "all_reduce", "all_gather_tensor": "all_gather", "all_gather_tensor_autograd": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_autograd": "reduce_scatter",
    "all_to_all_single": "all_to_all", "all_to_all_single_autograd": "all_to_all",
    "all_reduce_coalesced": "all_reduce", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
}
VOLUME_FACTOR = {"all_reduce": 2.0}  # the paper's convention: an all-reduce = reduce-scatter + all-gather


def _ring_factor(kind: str, n: int) -> float:
    """Bytes one rank sends per byte of the call's volume with ring algorithms."""
    if kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n if n > 0 else 0.0
    return 1.0


class Probe:
    def __init__(self, out_dir: str, rank: int):
        self.out_dir, self.rank = out_dir, rank
        self.step, self.phase = 0, "setup"
        self.records = {}  # (step, phase, kind, fn, dtype, n) -> [calls, elements, bytes]
        self.times = {"probe_start": time.time()}
        self.local = threading.local()
        self.group_sizes = {}
        self.overhead_s = 0.0
        self.calls = 0

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def add(self, kind: str, fn: str, tensors, n: int) -> None:
        first = None
        for t in tensors:
            try:
                numel, size = t.numel(), t.element_size()
                dtype = str(t.dtype).replace("torch.", "")
            except Exception:  # noqa: BLE001 - not a tensor: nothing to count
                continue
            key = (self.step, self.phase, kind, fn, dtype, n)
            r = self.records.setdefault(key, [0, 0, 0])
            r[1] += numel
            r[2] += numel * size
            first = first or key
        if first is None:  # a call without tensors (barrier): count the call
            first = (self.step, self.phase, kind, fn, "-", n)
            self.records.setdefault(first, [0, 0, 0])
        self.records[first][0] += 1
        self.calls += 1

    def group_size(self, group) -> int:
        import torch.distributed as dist

        key = id(group)
        if key not in self.group_sizes:
            try:
                self.group_sizes[key] = dist.get_world_size(group) if group is not None else dist.get_world_size()
            except Exception:  # noqa: BLE001
                self.group_sizes[key] = 0
        return self.group_sizes[key]

    def dump(self) -> None:
        self.times.setdefault("exit", time.time())
        rows = [{"step": k[0], "phase": k[1], "kind": k[2], "fn": k[3], "dtype": k[4], "group_size": k[5],
                 "calls": v[0], "elements": v[1], "bytes": v[2]} for k, v in self.records.items()]
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        cuda_peak = None
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                cuda_peak = torch.cuda.max_memory_allocated()
        except Exception:  # noqa: BLE001
            pass
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"rank{self.rank}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump({"rank": self.rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                       "times": self.times, "peak_rss_bytes": peak_rss, "cuda_peak_allocated_bytes": cuda_peak,
                       "probe_overhead_s": self.overhead_s, "counted_calls": self.calls, "records": rows}, fh)
        os.replace(path + ".tmp", path)

    # ---- wrapping ----------------------------------------------------------------------------------------------
    def _outer(self) -> bool:
        return getattr(self.local, "depth", 0) == 0

    def wrap_c10d(self, name: str, orig):
        kind, arg_names = C10D_OPS[name]
        sig = inspect.signature(orig)
        probe = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if not probe._outer():
                return orig(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                bound = sig.bind_partial(*args, **kwargs).arguments
                if kind == "p2p":
                    for op in bound.get("p2p_op_list") or ():
                        probe.add("send" if getattr(op.op, "__name__", "") == "isend" else "recv", name,
                                  [op.tensor], probe.group_size(op.group))
                else:
                    tensors = []
                    for a in arg_names:
                        v = bound.get(a)
                        if isinstance(v, (list, tuple)):
                            for x in v:
                                tensors.extend(x if isinstance(x, (list, tuple)) else [x])
                        elif v is not None:
                            tensors.append(v)
                    probe.add(kind, name, tensors, probe.group_size(bound.get("group")))
            except Exception:  # noqa: BLE001 - counting must never break training
                pass
            probe.overhead_s += time.perf_counter() - t0
            probe.local.depth = getattr(probe.local, "depth", 0) + 1
            try:
                return orig(*args, **kwargs)
            finally:
                probe.local.depth -= 1

        return wrapper

    def wrap_funcol(self, name: str, orig):
        kind = FUNCOL_OPS[name]
        probe = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if not probe._outer():
                return orig(*args, **kwargs)
            probe.local.depth = getattr(probe.local, "depth", 0) + 1
            try:
                out = orig(*args, **kwargs)
            finally:
                probe.local.depth -= 1
            t0 = time.perf_counter()
            try:
                inp = args[0] if args else next(iter(kwargs.values()))
                ins = list(inp) if isinstance(inp, (list, tuple)) else [inp]
                outs = list(out) if isinstance(out, (list, tuple)) else [out]
                n = max(1, round(outs[0].numel() / max(ins[0].numel(), 1))) if kind == "all_gather" else \
                    max(1, round(ins[0].numel() / max(outs[0].numel(), 1))) if kind == "reduce_scatter" else 0
                probe.add(kind, "funcol." + name, outs if kind == "all_gather" else ins, n)
            except Exception:  # noqa: BLE001
                pass
            probe.overhead_s += time.perf_counter() - t0
            return out

        return wrapper

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in C10D_OPS:
            orig = getattr(c10d, name, None)
            if orig is None:
                continue
            w = self.wrap_c10d(name, orig)
            setattr(c10d, name, w)
            if getattr(dist, name, None) is orig:
                setattr(dist, name, w)
        try:
            import torch.distributed._functional_collectives as funcol
        except Exception:  # noqa: BLE001
            return
        for name in FUNCOL_OPS:
            orig = getattr(funcol, name, None)
            if orig is not None:
                setattr(funcol, name, self.wrap_funcol(name, orig))

    def mark(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase


def _sync_device():
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass


def install_probe(out_dir: str) -> Probe:
    """Patch torch.distributed in this process; the counts go to <out_dir>/rank<R>.json at exit."""
    probe = Probe(out_dir, int(os.environ.get("RANK", "0")))
    probe.install()
    atexit.register(probe.dump)
    for sig in (signal.SIGTERM,):
        prev = signal.getsignal(sig)

        def handler(signum, frame, prev=prev):
            probe.dump()
            if callable(prev):
                prev(signum, frame)
            else:
                raise SystemExit(128 + signum)

        signal.signal(sig, handler)
    return probe


def probe_trainer(argv) -> None:
    """The probed entry: `bench_collectives.py --probe [--local_rank=N] <overrides>` runs trainer/main.py with the
    probe installed; the counts go to <hydra.run.dir>/probe/."""
    run_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")), None)
    if run_dir is None:
        raise SystemExit("bench_collectives --probe: pass hydra.run.dir=<dir>")
    probe = install_probe(os.path.join(run_dir, "probe"))
    t_launch = os.environ.get("TESSERA_BENCH_T0")
    if t_launch:
        probe.times["launch"] = float(t_launch)
    sys.path.insert(0, ROOT)
    from trainer import build as B

    orig_prepare, orig_build = B.prepare, B.build

    def prepare(*a, **k):
        probe.times["prepare_start"] = time.time()
        return orig_prepare(*a, **k)

    def build(*a, **k):
        probe.times["build_start"] = time.time()
        run = orig_build(*a, **k)
        _sync_device()
        probe.times["build_end"] = time.time()
        probe.num_params = run.num_params
        strategy = run.strategy
        fb, opt = strategy.forward_backward, strategy.optimizer_step

        def forward_backward(*a, **k):
            probe.mark(run.step + 1, "forward_backward")
            return fb(*a, **k)

        def optimizer_step(*a, **k):
            probe.mark(run.step + 1, "optimizer_step")
            out = opt(*a, **k)
            if "first_step_end" not in probe.times:
                _sync_device()
                probe.times["first_step_end"] = time.time()
            probe.mark(run.step + 1, "between")
            return out

        strategy.forward_backward, strategy.optimizer_step = forward_backward, optimizer_step
        return run

    B.prepare, B.build = prepare, build
    import runpy

    main = os.path.join(ROOT, "trainer", "main.py")
    sys.argv = [main, *argv]
    runpy.run_path(main, run_name="__main__")


# ================================================================================================================
# Reading a probed run
# ================================================================================================================
def read_probe(run_dir: str) -> list:
    pdir = os.path.join(run_dir, "probe")
    out = []
    if os.path.isdir(pdir):
        for name in sorted(os.listdir(pdir)):
            if name.startswith("rank") and name.endswith(".json"):
                with open(os.path.join(pdir, name)) as fh:
                    out.append(json.load(fh))
    return sorted(out, key=lambda r: r["rank"])


def step_volume(records, step: int) -> dict:
    """One rank's counts for one optimizer step -> totals and per-kind breakdown."""
    tot = {"calls": 0, "bytes_at_calls": 0, "volume_bytes": 0.0, "volume_elements": 0.0, "ring_bytes": 0.0,
           "by_kind": {}}
    for r in records:
        if r["step"] != step or r["phase"] not in ("forward_backward", "optimizer_step", "step"):
            continue
        f = VOLUME_FACTOR.get(r["kind"], 1.0)
        ring = _ring_factor(r["kind"], r["group_size"])
        k = tot["by_kind"].setdefault(r["kind"], {"calls": 0, "bytes": 0, "elements": 0, "dtypes": set(),
                                                  "fns": set()})
        k["calls"] += r["calls"]
        k["bytes"] += r["bytes"]
        k["elements"] += r["elements"]
        if r["dtype"] != "-":
            k["dtypes"].add(r["dtype"])
        k["fns"].add(r["fn"])
        tot["calls"] += r["calls"]
        tot["bytes_at_calls"] += r["bytes"]
        tot["volume_bytes"] += f * r["bytes"]
        tot["volume_elements"] += f * r["elements"]
        tot["ring_bytes"] += f * ring * r["bytes"]
    for k in tot["by_kind"].values():
        k["dtypes"], k["fns"] = sorted(k["dtypes"]), sorted(k["fns"])
    return tot


def expected_psi(strategy: str, accum: int, extra=None):
    """The paper's volume per optimizer step in Ψ with `accum` micro-batches per step, counting per micro-batch
    what a strategy communicates per micro-batch: DDP reduces once per step (no_sync until the last micro-batch):
    2Ψ; ZeRO-1 (DeepSpeed) reduces the accumulated gradients once and all-gathers the parameters once: 2Ψ; ZeRO-2
    reduces every micro-batch's gradients (it keeps only its partition) and all-gathers once: kΨ + Ψ; ZeRO-3 and
    FSDP gather in forward and backward and reduce-scatter in every micro-batch: 3kΨ; HSDP adds the all-reduce of
    the gradient shards across replicas (2Ψ/s) per micro-batch. k = 1 gives the paper's 2Ψ / 3Ψ."""
    k = max(1, accum)
    if strategy in ("ddp", "zero1"):
        return 2.0
    if strategy == "zero2":
        return k + 1.0
    if strategy in ("zero3", "zero3_offload", "fsdp"):
        return 3.0 * k
    if strategy == "hsdp":
        shard = next((int(x.split("=")[1]) for x in (extra or []) if x.startswith("strategy.dp_shard=")), 2)
        return (3.0 + 2.0 / shard) * k
    return None


def summarize(run_dir: str, strategy: str, num_params: int, world: int, extra=None, accum: int = 1) -> dict:
    """Per-rank figures of a probed run; `num_params` = Ψ, `accum` = micro-batches per optimizer step."""
    ranks = read_probe(run_dir)
    if not ranks:
        return {"error": f"no probe files in {run_dir}/probe"}
    steps = sorted({r["step"] for p in ranks for r in p["records"] if r["step"] > 0})
    max_step = max(steps) if steps else 0
    step = max(2, max_step - 1) if max_step >= 3 else max_step  # the last but one; the last checks it
    per_rank = []
    for p in ranks:
        v = step_volume(p["records"], step)
        v["rank"] = p["rank"]
        v["volume_psi"] = v["volume_elements"] / num_params if num_params else float("nan")
        v["steady"] = (step_volume(p["records"], step + 1)["volume_bytes"] == v["volume_bytes"]
                       if step + 1 <= max_step else None)  # the next step moved the same bytes
        v["probe_overhead_s"] = p.get("probe_overhead_s", 0.0)
        v["counted_calls_total"] = p.get("counted_calls", 0)
        per_rank.append(v)
    worst = max(per_rank, key=lambda v: v["volume_bytes"])
    theory = THEORY.get(strategy)
    if strategy == "hsdp":
        shard = next((int(x.split("=")[1]) for x in (extra or []) if x.startswith("strategy.dp_shard=")), 2)
        theory = 3.0 + 2.0 / shard
    expected = expected_psi(strategy, accum, extra)
    return {"strategy": strategy, "world_size": world, "psi": num_params, "step": step, "accum": accum,
            "theory_psi": theory, "theory_text": THEORY_TEXT.get(strategy), "expected_psi": expected,
            "volume_psi": worst["volume_psi"], "volume_bytes": worst["volume_bytes"],
            "bytes_at_calls": worst["bytes_at_calls"], "ring_bytes": worst["ring_bytes"], "calls": worst["calls"],
            "ratio": worst["volume_psi"] / expected if expected else None, "by_kind": worst["by_kind"],
            "steady": worst["steady"], "ranks": per_rank}


def timeline(run_dir: str) -> dict:
    """Launch -> first step, from rank 0's probe (the first step's end: the slowest rank's)."""
    ranks = read_probe(run_dir)
    if not ranks:
        return {}
    t = ranks[0]["times"]
    ends = [p["times"].get("first_step_end") for p in ranks if p["times"].get("first_step_end")]
    out = dict(t)
    if ends:
        out["first_step_end"] = max(ends)
    launch = t.get("launch", t["probe_start"])
    segs = {}
    marks = [("launcher + interpreter", "probe_start"), ("imports + config", "prepare_start"),
             ("checks + tokenizer + data", "build_start"), ("process group + model + strategy", "build_end"),
             ("first step", "first_step_end")]
    prev = launch
    for label, key in marks:
        if key in out:
            segs[label] = out[key] - prev
            prev = out[key]
    out["segments"] = segs
    out["launch_to_first_step_s"] = out["first_step_end"] - launch if "first_step_end" in out else None
    return out


def peak_memory(run_dir: str) -> dict:
    """Per-rank peak RSS / CUDA allocated (probe) and model states (the trainer's memory.json)."""
    ranks = read_probe(run_dir)
    out = {"peak_rss_bytes": [p.get("peak_rss_bytes") for p in ranks],
           "cuda_peak_allocated_bytes": [p.get("cuda_peak_allocated_bytes") for p in ranks]}
    mpath = os.path.join(run_dir, "memory.json")
    if os.path.exists(mpath):
        with open(mpath) as fh:
            mem = json.load(fh)
        out["model_states_bytes"] = [r.get("model_states") for r in mem.get("ranks", [])]
        out["model_states_between_steps_bytes"] = [
            sum((r.get("points", {}).get("after_step", {}) or {}).get(k, 0) or 0
                for k in ("params", "grads", "optimizer", "master_params")) for r in mem.get("ranks", [])]
        out["num_params"] = mem.get("num_params")
    return out


# ================================================================================================================
# Launching the trainer (shared with run_suite.py and bench_peers.py)
# ================================================================================================================
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_for(strategy: str, n: int) -> str:
    """What launch.sh picks: python for one process of `single`, deepspeed for ZeRO, torchrun otherwise."""
    if strategy in ZERO:
        return "deepspeed"
    return "python" if strategy == "single" and n == 1 else "torchrun"


def launch_cmd(script_args, launcher: str, n: int) -> list:
    py = sys.executable
    if launcher == "python":
        return [py, "-u", *script_args]
    if launcher == "deepspeed":
        return [os.path.join(VENV_BIN, "deepspeed"), "--num_gpus", str(n), "--master_port", str(free_port()),
                *script_args]
    return [py, "-m", "trainer.torchrun", "--nnodes", "1", "--nproc_per_node", str(n), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), *script_args]


def run_logged(cmd, env, log_path: str, timeout: float):
    """Run in its own process group (a timeout kills every rank); returns (exit code, seconds)."""
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    return rc, time.time() - t0


def tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()[-n:]
    except OSError:
        return ""


def run_tessera(strategy: str, n: int, overrides, work: str, tag: str, threads: int, timeout: float,
                probe: bool = True, env_extra=None, log_dir=None) -> dict:
    """One real training run through the launcher launch.sh would use, every rank through the probe."""
    os.makedirs(work, exist_ok=True)
    run_dir = os.path.join(work, tag)
    log_path = os.path.join(log_dir or work, f"{tag}.log")
    launcher = launcher_for(strategy, n)
    script = [os.path.abspath(__file__), "--probe"] if probe else [os.path.join(ROOT, "trainer", "main.py")]
    args = [f"strategy={strategy}", *overrides, f"hydra.run.dir={run_dir}"]
    cmd = launch_cmd([*script, *args], launcher, n)
    t0 = time.time()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", TESSERA_BENCH_T0=repr(t0), TESSERA_LAUNCH_TIME=repr(t0),
               **(env_extra or {}))
    rc, wall = run_logged(cmd, env, log_path, timeout)
    out = {"strategy": strategy, "world_size": n, "launcher": launcher, "run_dir": run_dir, "log": log_path,
           "returncode": rc, "wall_s": wall, "threads": threads,
           "command": " ".join(["OMP_NUM_THREADS=" + str(threads), *cmd[:1], *[
               c if " " not in c else repr(c) for c in cmd[1:]]])}
    if rc != 0:
        out["error"] = _failure_line(log_path, rc)
        return out
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            out["metrics"] = [json.loads(line) for line in fh if line.strip()]
    except OSError as e:
        out["error"] = f"no metrics.jsonl: {e}"
    return out


def _failure_line(log_path: str, rc) -> str:
    text = tail(log_path, 20000)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for key in ("Error", "error:", "error", "Traceback"):
        hits = [ln for ln in lines if key in ln and "WARNING" not in ln]
        if hits:
            return f"exit {rc}: {hits[-1][:300]}"
    return f"exit {rc}: {lines[-1][:300] if lines else 'no output'}"


def window_throughput(metrics, warmup: int) -> dict:
    """tokens/s over the logged windows that end after the warm-up steps (the windows' tokens / their summed
    time); also the target tokens per step and rank 0's peak memory as logged."""
    windows, prev = [], 0
    for r in metrics:
        tokens = r["tokens"] - prev
        prev = r["tokens"]
        windows.append((r["step"], tokens, tokens / r["tokens_per_s"] if r["tokens_per_s"] > 0 else 0.0))
    kept = [(t, s) for end, t, s in windows if end > warmup]
    tokens, seconds = sum(t for t, _ in kept), sum(s for _, s in kept)
    mfu = [r["mfu"] for r in metrics if r["step"] > warmup and "mfu" in r]
    return {"tokens_per_s": tokens / seconds if seconds > 0 else 0.0, "tokens": tokens, "seconds": seconds,
            "measured_steps": len(kept), "step_times_s": [s for _, s in kept], "step_tokens": [t for t, _ in kept],
            "mfu": sum(mfu) / len(mfu) if mfu else None,
            "final_loss": metrics[-1]["loss"] if metrics else None}


def run_overrides(model: str, precision: str, seq_len: int, global_batch: int, micro_batch: int, steps: int,
                  quick: bool, extra=()) -> list:
    return [f"model={model}", f"precision={precision}", f"data.seq_len={seq_len}",
            f"train.global_batch_size={global_batch}", f"train.micro_batch_size={micro_batch}",
            f"train.max_steps={steps}", "train.log_every=1", *QUIET, *(QUICK_MODEL if quick else []), *extra]


# ================================================================================================================
# CLI
# ================================================================================================================
DEFAULTS = dict(model="llama_100m", strategies="ddp,zero1,zero2,zero3,fsdp", world_sizes="2", seq_len=64,
                micro_batch=1, steps=3, precision="bf16")
QUICK = dict(model="tiny", strategies="ddp,zero2,zero3,fsdp", world_sizes="2", seq_len=32, micro_batch=1,
             steps=3, precision="bf16")


def fmt_bytes(b) -> str:
    return "—" if b is None else f"{b / MIB:.1f}"


def table(rows) -> str:
    """Markdown table of the collectives rows."""
    out = ["| strategy | N | k | Ψ (params) | measured volume | theory (k = 1) | expected at k | measured / expected | "
           "at the calls (MiB) | volume (MiB) | ring traffic per rank (MiB) | calls | by collective (volume in Ψ, "
           "dtype) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['strategy']} | {r['world_size']} | | | not measured: {r['error']} |||||||||")
            continue
        psi = r["psi"]
        kinds = "; ".join(
            f"{k} {VOLUME_FACTOR.get(k, 1.0) * v['elements'] / psi:.2f}Ψ ({'/'.join(v['dtypes'])}, {v['calls']}x)"
            for k, v in sorted(r["by_kind"].items(), key=lambda kv: -kv[1]["elements"]))
        theory = f"{r['theory_text']} = {r['theory_psi']:.2f}Ψ" if r["theory_psi"] else "—"
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "—"
        expected = f"{r['expected_psi']:.2f}Ψ" if r.get("expected_psi") else "—"
        out.append(f"| {r['strategy']} | {r['world_size']} | {r['accum']} | {psi / 1e6:.2f}M | "
                   f"{r['volume_psi']:.3f}Ψ | {theory} | {expected} | {ratio} | {fmt_bytes(r['bytes_at_calls'])} | "
                   f"{fmt_bytes(r['volume_bytes'])} | {fmt_bytes(r['ring_bytes'])} | {r['calls']} | {kinds} |")
    return "\n".join(out)


def measure(strategies, world_sizes, model, precision, seq_len, micro_batch, steps, quick, threads, work,
            timeout, extra=(), log=print) -> list:
    rows = []
    for n in world_sizes:
        for s in strategies:
            so = strategy_overrides(s, n)
            if so is None:
                log(f"  {s} at N={n}: not run ({NOT_RUN_WHY.get(s, 'not valid at this size')})")
                continue
            ov = run_overrides(model, precision, seq_len, micro_batch * n, micro_batch, steps, quick, [*so, *extra])
            r = run_tessera(s, n, ov, work, f"coll-{s}-n{n}", threads or 1, timeout)
            if "error" in r:
                rows.append({"strategy": s, "world_size": n, "error": r["error"]})
                log(f"  {s} N={n}: failed ({r['error']}); log {r['log']}")
                continue
            mem = peak_memory(r["run_dir"])
            psi = mem.get("num_params") or 0
            row = summarize(r["run_dir"], s, psi, n, so, accum=n // dp_degree(s, n))
            row["overrides"] = ov
            rows.append(row)
            log(f"  {s} N={n}: {row['volume_psi']:.3f}Ψ per step (theory {row['theory_text'] or '—'}), "
                f"{fmt_bytes(row['volume_bytes'])} MiB, {row['calls']} calls  ({r['wall_s']:.0f} s)")
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=f"preset in conf/model (default {DEFAULTS['model']})")
    ap.add_argument("--strategies", help=f"comma-separated (default {DEFAULTS['strategies']})")
    ap.add_argument("--world-sizes", help="comma-separated (default 2)")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default bf16")
    ap.add_argument("--seq-len", type=int, help=f"default {DEFAULTS['seq_len']}")
    ap.add_argument("--micro-batch", type=int, help="sequences per rank per step (default 1; global = N x this)")
    ap.add_argument("--steps", type=int, help="optimizer steps (default 3; the last but one is reported, the last "
                                              "checks it)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank (default 1)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra Hydra override")
    ap.add_argument("--quick", action="store_true", help="debug-size model, ddp/zero2/zero3/fsdp at N = 2")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    a = ap.parse_args(argv)
    base = QUICK if a.quick else DEFAULTS
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def run_and_report(a, prefix: str, table_of, measure_in):
    """The command-line tail the benchmark scripts share: measure in a temporary work folder (kept with --keep),
    print the table, and write the config and rows as JSON to --out."""
    work = tempfile.mkdtemp(prefix=prefix)
    try:
        rows = measure_in(work)
    finally:
        if a.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table_of(rows))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump({"config": vars(a), "rows": rows}, fh, indent=2, default=str)
        print(f"wrote {a.out}")
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--probe" in argv:
        probe_trainer([x for x in argv if x != "--probe"])
        return 0
    a = parse_args(argv)
    strategies = [s for s in a.strategies.split(",") if s]
    sizes = [int(x) for x in a.world_sizes.split(",") if x]
    print(f"model {a.model}{' (debug size)' if a.quick else ''} | {a.precision} | seq_len {a.seq_len} | micro-batch "
          f"{a.micro_batch} per rank | {a.steps} steps, the last but one reported", flush=True)
    rows = run_and_report(a, "tessera-coll-", table, lambda work: measure(
        strategies, sizes, a.model, a.precision, a.seq_len, a.micro_batch, a.steps, a.quick, a.threads, work,
        a.timeout, a.set, log=lambda m: print(m, flush=True)))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
