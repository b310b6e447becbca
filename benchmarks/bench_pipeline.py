#!/usr/bin/env python
"""Pipeline bubble of each pipeline schedule (strategy=pp): the idle fraction of every pipeline rank, measured
from timings, next to the schedule's theoretical bubble, and the step time per schedule.

    python benchmarks/bench_pipeline.py                         # all 7 schedules, pp=2, m = 4 and 8 micro-batches
    python benchmarks/bench_pipeline.py --schedules gpipe,1f1b,zbv --micro-batches 4,8,16 --out /tmp/pp.json
    python benchmarks/bench_pipeline.py --pp 2,4                # pp=4 too: 4 processes (see the caveat below)
    python benchmarks/bench_pipeline.py --quick --out /tmp/p.json   # gpipe + 1f1b, a small model: the smoke test

One launch of `python -m torch.distributed.run --nproc_per_node <pp>` per pipeline degree runs this file as a
worker (`--worker`); the worker builds one run per (schedule, m) the way trainer/main.py builds it (Hydra compose
of conf/, trainer.build.prepare -> build; strategy=pp, strategy.pp_schedule=<schedule>, global batch =
m x micro-batch, so gradient accumulation = m micro-batches per step) and trains `--warmup` + `--steps` steps
with trainer.loop.fit. All runs of a launch share one gloo process group. Measurement, from outside the product
code (this worker wraps methods of torch's pipelining classes and of the built strategy):

* busy time: the wall time inside `_PipelineStageBase.forward_one_chunk` (F), `backward_one_chunk` (B: full
  backward, or I: input gradient only in the zero-bubble schedules) and `backward_weight_one_chunk` (W), and
  the schedule's loss computation on the last stage (`_PipelineSchedule._compute_loss`, counted with F). The
  p2p sends and receives and the waits for them lie outside these calls: they count as idle.
* pipeline time of a step: every rank enters `strategy.forward_backward` through a barrier; the step's pipeline
  runs from the first rank's exit of that barrier to the end of the last rank's torch `schedule.step()`, on one
  clock (time.perf_counter, CLOCK_MONOTONIC, shared by the processes of one machine).
* idle fraction of rank r (and its stages) = 1 - busy_r / pipeline time, over the measured steps together; also
  for the fastest measured step alone (the one least disturbed by other load on a shared machine).
* step time: the same start -> end of the last rank's optimizer step (forward_backward + the global gradient
  norm and AdamW step); the median over the measured steps.
* CPU in busy: the computing thread's CPU time (time.thread_time) / wall time inside the busy calls: below ~95%
  the rank was descheduled while computing (other load, or more busy threads than cores).
* theory: the bubble fraction of the schedule from its paper with equal stages and F = B(input) = W (so a full
  backward = 2F), p pipeline ranks, v stages per rank, m micro-batches (see THEORY below).
* sim: the same step replayed in a simulator: each rank's F/B/I/W calls in the order they ran, each with its
  measured duration, data dependencies between stages, and free, instant communication. "order" is that replay
  with ideal unit durations (F = I = W = 1, B = 2): the theory of the schedule as torch orders it.
  measured - sim = communication, synchronisation and Python overhead; sim - order = unequal F/B/W and stages.

Caveats: on a CPU machine with gloo, communication is not overlapped with compute (no separate stream as with
NCCL on a GPU: torch's schedules wait for each batch of sends/receives between compute calls, and gloo moves the
bytes on the same cores), so idle includes communication and copies. Use one thread per
process and no more processes than cores: with pp=4 on 2 cores, ranks are descheduled while "busy" and the
timings mean nothing (the benchmark says so). Timings on a shared machine are noisy: look at the load average.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")

RUN_OVERRIDES = [
    "strategy=pp", "optim=adamw", "precision=fp32", "scheduler=constant", "scheduler.warmup_steps=0",
    "train.log_every=1000000", "eval.every=0", "eval.at_start=false", "eval.at_end=false",
    "export.hf_at_end=false", "logging.progress=false", "logging.tensorboard=false", "checkpoint.every=0",
    "checkpoint.at_end=false", "checkpoint.resume=none", "data.embedded_documents=400",
]
# The default model: the tiny Llama preset (hidden 256, 8 heads / 4 KV heads, MLP 704) with 8 decoder blocks.
DEFAULT_MODEL = ["model=tiny", "model.num_layers=8"]
QUICK_MODEL = ["model=tiny", "model.hidden_size=64", "model.num_layers=4", "model.num_heads=4",
               "model.num_kv_heads=2", "model.intermediate_size=128"]
DEFAULTS = dict(schedules=",".join(SCHEDULES), pp="2", micro_batches="4,8", micro_batch_size=2, seq_len=128,
                warmup=2, steps=5)
QUICK = dict(schedules="gpipe,1f1b", pp="2", micro_batches="4", micro_batch_size=1, seq_len=32, warmup=1, steps=2)

# ---------------------------------------------------------------------------------------------------------------
# Theory
# ---------------------------------------------------------------------------------------------------------------
THEORY = {
    # schedule: (formula as text, source)
    "gpipe": ("(p-1)/(m+p-1)", "GPipe, Huang et al. 2019: fill and drain of p stages around m micro-batches"),
    "1f1b": ("(p-1)/(m+p-1)", "1F1B / PipeDream-Flush, Narayanan et al. 2021 sec. 2.2.1: the same bubble as "
                              "GPipe, less activation memory"),
    "interleaved_1f1b": ("(p-1)/(v*m+p-1)", "interleaved 1F1B, Narayanan et al. 2021 sec. 2.2.2: v stages per "
                                            "rank shrink the bubble v times"),
    "looped_bfs": ("(p-1)/(v*m+p-1)", "breadth-first looping, Lamy-Poirier 2023: the interleaved bubble "
                                      "(m >= p)"),
    "interleaved_zb": ("(p-1)/(3*v*m+p-1)", "ZB-H1 / ZB1P, Qi et al. 2024 (arXiv 2401.10241): bubble "
                                            "(p-1)(F+B-W) = (p-1)F with F=B=W, 1/3 of 1F1B's, on chunks of 1/v"),
    "zbv": ("(p-1)/(6*m+p-1)", "ZB-V, Qi et al. 2024 sec. 6: no bubble in the steady state when F=B=W (their 0 "
                               "also needs optimizer post-validation, which removes the step boundary); in a "
                               "synchronous step the last rank still waits (p-1) chunk forwards before its first "
                               "action, out of 2m(F+B+W) = 6m per rank"),
    "dualpipev": ("(p-1)/(6*m+p-1)", "DualPipeV (DeepSeek-V3 report; deepseek-ai/DualPipe): zero bubble in the "
                                     "steady state, so the same warm-up bound as ZB-V. Its README's bubble "
                                     "(PP/2-1)(F&B+B-3W) over PP = 2p stages, with F&B = F+B (torch runs the "
                                     "overlapped pair one after the other), gives about twice that, (p-1)/(3m+p-1); "
                                     "torch's order replays at the bound"),
}


def theory(schedule: str, p: int, v: int, m: int) -> float:
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (p - 1) / (v * m + p - 1)
    if schedule == "interleaved_zb":
        return (p - 1) / (3 * v * m + p - 1)
    if schedule in ("zbv", "dualpipev"):
        return (p - 1) / (6 * m + p - 1)
    raise ValueError(schedule)


# ---------------------------------------------------------------------------------------------------------------
# Replay of a step's actions with given durations (no communication cost)
# ---------------------------------------------------------------------------------------------------------------
UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def simulate(orders, num_stages: int, durations=None):
    """orders: per rank, the list of (kind, stage, micro-batch, seconds) in the order the rank ran them (kind F, B
    = full backward, I = input-gradient backward, W = weight backward). Each rank runs its list in order; an
    action starts when the rank is free and its inputs exist: F(s, mb) after F(s-1, mb); B/I(s, mb) after F(s, mb)
    and B/I(s+1, mb); W(s, mb) after I(s, mb). durations=None: the measured seconds; else a {kind: time} map.
    -> (makespan, [busy per rank]), or None where the dependencies cannot be met."""
    fwd, grad = {}, {}
    free = [0.0] * len(orders)
    pos = [0] * len(orders)
    busy = [0.0] * len(orders)
    left = sum(len(o) for o in orders)
    while left:
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, s, mb, sec = order[pos[r]]
                deps = []
                if kind == "F":
                    deps = [fwd.get((s - 1, mb))] if s > 0 else []
                elif kind in ("B", "I"):
                    deps = [fwd.get((s, mb))] + ([grad.get((s + 1, mb))] if s < num_stages - 1 else [])
                elif kind == "W":
                    deps = [grad.get((s, mb))]
                if any(d is None for d in deps):
                    break
                dur = sec if durations is None else durations[kind]
                end = max([free[r]] + deps) + dur
                free[r] = end
                busy[r] += dur
                if kind == "F":
                    fwd[(s, mb)] = end
                elif kind in ("B", "I"):
                    grad[(s, mb)] = end
                pos[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            return None
    return max(free), busy


def sim_idle(orders, num_stages: int, durations=None):
    out = simulate(orders, num_stages, durations)
    if out is None or out[0] <= 0:
        return None
    makespan, busy = out
    return 1 - sum(busy) / (len(busy) * makespan)


# ---------------------------------------------------------------------------------------------------------------
# Worker (one process per pipeline rank, under torch.distributed.run)
# ---------------------------------------------------------------------------------------------------------------
class Probe:
    """Timers around torch's pipeline stage calls and the strategy's step; events are kept while `on`."""

    def __init__(self):
        self.on = False
        self.events = []  # (kind, stage, micro-batch, t0, t1, CPU seconds of this thread in between)
        self.steps = []   # per step: {"start", "schedule_end", "fb_end", "step_end", "events"} (absolute seconds)
        self.t0 = 0.0
        self.t_sched = None

    def install_torch_hooks(self) -> None:
        from torch.distributed.pipelining import schedules, stage

        base = stage._PipelineStageBase
        probe = self

        def timed(kind_of):
            def deco(orig):
                @functools.wraps(orig)
                def wrapper(self, *args, **kwargs):
                    if not probe.on:
                        return orig(self, *args, **kwargs)
                    c0, t0 = time.thread_time(), time.perf_counter()
                    out = orig(self, *args, **kwargs)
                    kind, mb = kind_of(self, args, kwargs)
                    probe.events.append((kind, self.stage_index, mb, t0, time.perf_counter(),
                                         time.thread_time() - c0))
                    return out
                return wrapper
            return deco

        def fwd(st, args, kwargs):
            return "F", args[0] if args else kwargs.get("fwd_chunk_id")

        def bwd(st, args, kwargs):
            full = args[2] if len(args) > 2 else kwargs.get("full_backward", True)
            return ("B" if full else "I"), args[0] if args else kwargs.get("bwd_chunk_id")

        def wgt(st, args, kwargs):
            return "W", args[0] if args else kwargs.get("bwd_chunk_id")

        base.forward_one_chunk = timed(fwd)(base.forward_one_chunk)
        base.backward_one_chunk = timed(bwd)(base.backward_one_chunk)
        base.backward_weight_one_chunk = timed(wgt)(base.backward_weight_one_chunk)

        orig_loss = schedules._PipelineSchedule._compute_loss

        @functools.wraps(orig_loss)
        def loss(self, *args, **kwargs):
            if not probe.on:
                return orig_loss(self, *args, **kwargs)
            c0, t0 = time.thread_time(), time.perf_counter()
            out = orig_loss(self, *args, **kwargs)
            probe.events.append(("L", self._num_stages - 1, None, t0, time.perf_counter(), time.thread_time() - c0))
            return out

        schedules._PipelineSchedule._compute_loss = loss

    def instrument(self, strategy) -> None:
        import torch.distributed as dist

        probe = self
        self.steps = []
        fb, opt, sched_step = strategy.forward_backward, strategy.optimizer_step, strategy.schedule.step

        def schedule_step(*args, **kwargs):
            out = sched_step(*args, **kwargs)
            probe.t_sched = time.perf_counter()
            return out

        def forward_backward(*args, **kwargs):
            dist.barrier()
            probe.events, probe.t_sched, probe.on = [], None, True
            probe.t0 = time.perf_counter()
            try:
                return fb(*args, **kwargs)
            finally:
                t = time.perf_counter()
                probe.on = False
                # Absolute times of time.perf_counter (CLOCK_MONOTONIC, one clock for every process of this
                # machine): the summary puts all ranks of a step on one time axis.
                probe.steps.append({"start": probe.t0, "schedule_end": probe.t_sched or t, "fb_end": t,
                                    "events": list(probe.events)})

        def optimizer_step(*args, **kwargs):
            out = opt(*args, **kwargs)
            if probe.steps:
                probe.steps[-1]["step_end"] = time.perf_counter()
            return out

        strategy.schedule.step = schedule_step
        strategy.forward_backward = forward_backward
        strategy.optimizer_step = optimizer_step


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from trainer.cli import register_resolvers
    from trainer.config import register_configs, to_object

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        return to_object(hydra_compose(config_name="config", overrides=list(overrides)))


def close_keeping_group(run) -> None:
    """trainer.build.close, except that the process group stays for the next run of this launch."""
    from trainer import build as B
    from trainer import parallel

    destroy = parallel.destroy_process_group
    parallel.destroy_process_group = lambda: None
    try:
        B.close(run)
    finally:
        parallel.destroy_process_group = destroy


def worker_run(job: dict, base: list, work: str, probe: Probe) -> dict:
    import torch
    import torch.distributed as dist

    from trainer import build as B
    from tessera.errors import ConfigError
    from trainer.loop import fit

    schedule, m = job["schedule"], job["m"]
    overrides = base + [f"strategy.pp_schedule={schedule}",
                        f"train.global_batch_size={m * job['micro_batch_size']}",
                        f"train.max_steps={job['warmup'] + job['steps']}"]
    run_dir = os.path.join(work, f"{schedule}-pp{job['pp']}-m{m}")
    t_build = time.perf_counter()
    try:
        prepared = B.prepare(compose(overrides), run_dir)
    except ConfigError as e:  # the same on every rank: skip this row on all of them
        return {"skipped": str(e)}
    run = B.build(prepared)
    try:
        build_s = time.perf_counter() - t_build
        strategy = run.strategy
        probe.instrument(strategy)
        t_fit = time.perf_counter()
        fit(run)
        fit_s = time.perf_counter() - t_fit
        mine = {"rank": dist.get_rank(), "pp_rank": strategy.pp_rank, "stages": list(strategy.my_stages),
                "num_stages": strategy.num_stages, "steps": probe.steps[job["warmup"]:],
                "grad_accum": run.grad_accum, "num_params": run.num_params, "threads": torch.get_num_threads()}
    finally:
        close_keeping_group(run)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return {"ranks": ranks, "build_s": build_s, "fit_s": fit_s}


def worker(spec_path: str) -> int:
    with open(spec_path) as fh:
        spec = json.load(fh)
    import torch

    torch.set_num_threads(spec["threads"])
    import torch.distributed as dist

    from trainer import parallel

    parallel.init_process_group(torch.device("cpu"), spec["collective_timeout"])
    probe = Probe()
    probe.install_torch_hooks()
    results = []
    for job in spec["jobs"]:
        t = time.perf_counter()
        res = worker_run(job, spec["base"], spec["work"], probe)
        res.update(job=job, wall_s=time.perf_counter() - t)
        results.append(res)
        if dist.get_rank() == 0:
            note = f"skipped: {res['skipped']}" if "skipped" in res else f"{res['wall_s']:.1f} s"
            print(f"[bench_pipeline] {job['schedule']} pp={job['pp']} m={job['m']}: {note}", file=sys.stderr,
                  flush=True)
            with open(spec["result"], "w") as fh:  # after every run: with --keep, a later failure leaves these
                json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Summary (main process)
# ---------------------------------------------------------------------------------------------------------------
def ordered_actions(step: dict):
    """A step's events as (kind, stage, mb, seconds) in order, the loss merged into the forward before it."""
    out = []
    for kind, s, mb, a, b, _ in sorted(step["events"], key=lambda e: e[3]):
        if kind == "L":
            for i in range(len(out) - 1, -1, -1):
                if out[i][0] == "F" and out[i][1] == s:
                    out[i] = (out[i][0], s, out[i][2], out[i][3] + (b - a))
                    break
            continue
        out.append((kind, s, mb, b - a))
    return out


def summarize(res: dict) -> dict:
    job = res["job"]
    ranks = sorted(res["ranks"], key=lambda r: r["pp_rank"])
    p, m, schedule = job["pp"], job["m"], job["schedule"]
    v = len(ranks[0]["stages"])
    n = min(len(r["steps"]) for r in ranks)
    if n == 0:
        raise RuntimeError(f"{schedule}: no measured steps (raise --steps)")
    steps = range(n)
    num_stages = ranks[0]["num_stages"]
    # A step starts when the first rank leaves the barrier (all have arrived); its pipeline ends when the last
    # rank's schedule.step() returns, the training step when the last rank's optimizer step returns.
    start = [min(r["steps"][k]["start"] for r in ranks) for k in steps]
    pipe = [max(r["steps"][k]["schedule_end"] for r in ranks) - start[k] for k in steps]
    step = [max(r["steps"][k].get("step_end", r["steps"][k]["fb_end"]) for r in ranks) - start[k] for k in steps]
    skew = [max(r["steps"][k]["start"] for r in ranks) - start[k] for k in steps]
    busy = [[sum(e[4] - e[3] for e in r["steps"][k]["events"]) for k in steps] for r in ranks]  # [rank][step]
    cpu = [[sum(e[5] for e in r["steps"][k]["events"]) for k in steps] for r in ranks]
    orders = [[ordered_actions(r["steps"][k]) for r in ranks] for k in steps]  # [step][rank]
    sims = [sim_idle(orders[k], num_stages) for k in steps]
    ideal = [sim_idle(orders[k], num_stages, UNIT) for k in steps]

    per_rank, ops = [], {}  # ops: (stage, kind) -> durations
    for i, r in enumerate(ranks):
        counts = {}
        for k in steps:
            for kind, st, _, sec in orders[k][i]:
                ops.setdefault((st, kind), []).append(sec)
                counts[kind] = counts.get(kind, 0) + 1
        per_rank.append({"rank": r["rank"], "pp_rank": r["pp_rank"], "stages": r["stages"],
                         "busy_s": sum(busy[i]) / n, "idle": 1 - sum(busy[i]) / sum(pipe),
                         "idle_per_step": [1 - busy[i][k] / pipe[k] for k in steps],
                         "own_schedule_s": statistics.median(r["steps"][k]["schedule_end"] - r["steps"][k]["start"]
                                                             for k in steps),
                         "cpu_share_busy": sum(cpu[i]) / sum(busy[i]) if sum(busy[i]) else None,
                         "actions_per_step": {kind: c // n for kind, c in sorted(counts.items())}})
    kinds = {}
    for (st, kind), d in ops.items():
        kinds.setdefault(kind, []).extend(d)
    f = min(steps, key=lambda k: pipe[k])  # the fastest step: the least disturbed by other load
    fastest_idle = [1 - busy[i][f] / pipe[f] for i in range(len(ranks))]
    known = [x for x in sims if x is not None]
    return {
        "schedule": schedule, "pp": p, "stages_per_rank": v, "num_stages": num_stages, "micro_batches": m,
        "micro_batch_size": job["micro_batch_size"], "measured_steps": n,
        "theory": theory(schedule, p, v, m), "theory_formula": THEORY[schedule][0],
        "theory_source": THEORY[schedule][1],
        "idle_per_rank": [x["idle"] for x in per_rank], "idle_mean": statistics.mean(x["idle"] for x in per_rank),
        "cpu_share_busy": min(x["cpu_share_busy"] or 0 for x in per_rank),
        "sim_idle": statistics.median(known) if known else None,
        "order_idle": statistics.median(x for x in ideal if x is not None) if any(x is not None for x in ideal)
        else None,
        "pipeline_s": statistics.median(pipe), "step_s": statistics.median(step),
        "fastest_step": {"index": f, "pipeline_s": pipe[f], "step_s": step[f], "idle_per_rank": fastest_idle,
                         "idle_mean": statistics.mean(fastest_idle), "sim_idle": sims[f],
                         "cpu_share_busy": min(cpu[i][f] / busy[i][f] if busy[i][f] else 0
                                               for i in range(len(ranks)))},
        "pipeline_s_per_step": pipe, "step_s_per_step": step, "sim_idle_per_step": sims,
        "barrier_exit_skew_s": skew,
        "op_ms_mean": {kind: 1e3 * statistics.mean(d) for kind, d in sorted(kinds.items())},
        "op_ms": {f"stage{st}_{kind}": 1e3 * statistics.mean(d) for (st, kind), d in sorted(ops.items())},
        "ranks": per_rank, "build_s": res["build_s"], "fit_s": res["fit_s"], "num_params": ranks[0]["num_params"],
        "threads_per_rank": ranks[0]["threads"],
    }


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def table(rows) -> str:
    lines = ["| schedule | p | v | m | theory | order | sim | idle per rank (measured) | idle mean | "
             "idle mean, fastest step | pipeline s | step s | F / B / I / W ms | CPU in busy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['schedule']} | {r['pp']} | | {r['micro_batches']} | skipped: "
                         f"{r['skipped'].strip().splitlines()[-1].strip(' -')} |||||||||||")
            continue
        ops = " / ".join(f"{r['op_ms_mean'][k]:.1f}" if k in r["op_ms_mean"] else "—" for k in "FBIW")
        fs = r["fastest_step"]
        idle = " ".join(_pct(x) for x in r["idle_per_rank"])
        lines.append(f"| {r['schedule']} | {r['pp']} | {r['stages_per_rank']} | {r['micro_batches']} | "
                     f"{_pct(r['theory'])} {r['theory_formula']} | {_pct(r['order_idle'])} | {_pct(r['sim_idle'])} "
                     f"| {idle} | {_pct(r['idle_mean'])} | {_pct(fs['idle_mean'])} (sim {_pct(fs['sim_idle'])}, "
                     f"{fs['pipeline_s']:.3f} s, CPU {_pct(fs['cpu_share_busy'])}) | {r['pipeline_s']:.3f} | "
                     f"{r['step_s']:.3f} | {ops} | "
                     f"{_pct(r['cpu_share_busy'])} |")
    return "\n".join(lines)


NOTES = """Columns: p pipeline ranks, v stages per rank, m micro-batches per step (= gradient accumulation).
  theory: the schedule's bubble fraction from its paper, equal stages, F = B(input) = W (sources in --out JSON
          and the script's THEORY); order: torch's own action order for this step replayed with F=I=W=1, B=2 and
          free communication; sim: the same replay with each action's measured duration.
  idle per rank: 1 - (time in forward/backward/weight-backward/loss calls) / pipeline time, per pipeline rank
          in rank order, over the measured steps; idle mean: their mean; fastest step: the same in the measured
          step with the shortest pipeline time (the least disturbed by other load on a shared machine), with
          that step's sim, its pipeline time and CPU in busy.
  pipeline s: barrier -> end of the torch schedule's step(), largest over the ranks (median over steps);
  step s: barrier -> end of the optimizer step (incl. gradient-norm all-reduce), likewise.
  F / B / I / W ms: mean duration of a forward (with the loss on the last stage), full backward, input-gradient
          backward and weight backward of one stage and micro-batch.
  CPU in busy: CPU time of the computing thread / wall time inside those calls, lowest rank; well below 100%
          means the rank was descheduled while computing (more busy threads than cores): timings are unreliable.
  measured - sim: communication (gloo p2p is synchronous on CPU), waits and Python overhead between actions."""


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(a, pp: int, jobs, work: str):
    spec_path = os.path.join(work, f"spec-pp{pp}.json")
    result_path = os.path.join(work, f"result-pp{pp}.json")
    collective_timeout = int(min(a.timeout, 300))
    base = RUN_OVERRIDES + (QUICK_MODEL if a.quick else DEFAULT_MODEL) + [
        f"train.micro_batch_size={a.micro_batch_size}", f"data.seq_len={a.seq_len}",
        f"strategy.pp_stages_per_rank={a.stages_per_rank}",
        f"train.collective_timeout_s={collective_timeout}"] + list(a.set)
    spec = {"jobs": jobs, "base": base, "work": work, "result": result_path, "threads": a.threads,
            "collective_timeout": collective_timeout}
    with open(spec_path, "w") as fh:
        json.dump(spec, fh)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads), PYTHONUNBUFFERED="1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={pp}", f"--master_port={free_port()}",
           os.path.abspath(__file__), "--worker", spec_path]
    log_path = os.path.join(work, f"log-pp{pp}.txt")
    t = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            rc = "timeout"
    with open(log_path) as fh:
        log_text = fh.read()
    if a.verbose:
        sys.stdout.write(log_text)
    if rc != 0:
        sys.stderr.write(f"bench_pipeline: the pp={pp} launch failed ({rc}); its output:\n{log_text[-6000:]}\n"
                         f"(with --keep, {result_path} keeps the runs that finished before the failure)\n")
        raise SystemExit(1)
    with open(result_path) as fh:
        return json.load(fh), time.perf_counter() - t


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", help=f"comma-separated, of {', '.join(SCHEDULES)} (default all)")
    ap.add_argument("--pp", help="pipeline degrees = processes, comma-separated (default 2)")
    ap.add_argument("--micro-batches", help="micro-batches per step m, comma-separated (default 4,8)")
    ap.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch (default 2)")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default 128)")
    ap.add_argument("--stages-per-rank", type=int, default=2,
                    help="strategy.pp_stages_per_rank for interleaved_1f1b, looped_bfs, interleaved_zb (default 2; "
                         "zbv and dualpipev always have 2)")
    ap.add_argument("--warmup", type=int, help="steps not measured, the first infers shapes (default 2)")
    ap.add_argument("--steps", type=int, help="measured steps (default 5)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS and torch threads per rank (default 1)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra Hydra override for every run, e.g. --set model.num_layers=16")
    ap.add_argument("--quick", action="store_true",
                    help="gpipe + 1f1b, pp=2, m=4, a hidden-64 4-layer model, seq 32, 1 + 2 steps (the smoke test)")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (run dirs, logs, raw timings)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per launch (default 1800)")
    ap.add_argument("--verbose", action="store_true", help="show the workers' output")
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return a
    for k, v in (QUICK if a.quick else DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.schedule_list = [s.strip() for s in a.schedules.split(",") if s.strip()]
    a.pp_list = [int(x) for x in str(a.pp).split(",") if x.strip()]
    a.m_list = [int(x) for x in str(a.micro_batches).split(",") if x.strip()]
    bad = [s for s in a.schedule_list if s not in SCHEDULES]
    if bad or not a.schedule_list or not a.pp_list or min(a.pp_list) < 2 or not a.m_list or min(a.m_list) < 1 \
            or a.steps < 1 or a.warmup < 1 or a.threads < 1 or a.micro_batch_size < 1:
        ap.error(f"--schedules must name {'/'.join(SCHEDULES)} (got {bad or a.schedules}); --pp >= 2; "
                 f"--micro-batches, --steps, --warmup (the first step infers shapes), --threads >= 1")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker(a.worker)
    cores = os.cpu_count() or 1
    work = tempfile.mkdtemp(prefix="bench-pipeline-")
    rows, launches = [], []
    load_before = os.getloadavg()[0]
    try:
        for pp in a.pp_list:
            if pp * a.threads > cores:
                print(f"WARNING: pp={pp} x {a.threads} thread(s) = {pp * a.threads} busy threads on {cores} cores: "
                      f"ranks are descheduled while computing, so busy and idle times are meaningless here "
                      f"(the run still checks that the schedules work)", flush=True)
            jobs = [{"schedule": s, "m": m, "pp": pp, "micro_batch_size": a.micro_batch_size,
                     "warmup": a.warmup, "steps": a.steps} for s in a.schedule_list for m in a.m_list]
            results, secs = launch(a, pp, jobs, work)
            launches.append({"pp": pp, "seconds": secs, "oversubscribed": pp * a.threads > cores})
            for res in results:
                job = res["job"]
                if "skipped" in res:
                    rows.append({"schedule": job["schedule"], "pp": pp, "micro_batches": job["m"],
                                 "skipped": res["skipped"]})
                    continue
                row = summarize(res)
                row["oversubscribed"] = pp * a.threads > cores
                rows.append(row)
                print(f"{row['schedule']} pp={pp} m={job['m']}: idle {_pct(row['idle_mean'])} (theory "
                      f"{_pct(row['theory'])}), pipeline {row['pipeline_s']:.3f} s, step {row['step_s']:.3f} s",
                      flush=True)
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    done = [r for r in rows if "skipped" not in r]
    print()
    model = "quick size (hidden 64, 4 layers)" if a.quick else "tiny preset with 8 decoder blocks (hidden 256)"
    print(f"Pipeline bubble per schedule: {model}, {done[0]['num_params'] / 1e6:.2f}M params, " if done else
          "Pipeline bubble per schedule: ", end="")
    print(f"seq_len {a.seq_len}, micro-batch {a.micro_batch_size}, fp32, gloo on CPU, {a.threads} thread(s) per rank, "
          f"{cores} cores; {a.warmup} warm-up + {a.steps} measured steps; load average before {load_before:.2f}, "
          f"after {os.getloadavg()[0]:.2f}{'; ' + ' '.join(a.set) if a.set else ''}.")
    print()
    print(table(rows))
    over = [str(x["pp"]) for x in launches if x["oversubscribed"]]
    if over:
        print(f"\nWARNING: the pp={','.join(over)} rows ran more busy threads than the {cores} cores: their measured "
              f"figures (idle, sim, times) are meaningless; theory and order still hold.")
    print()
    print(NOTES)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)) or ".", exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump({"config": {"quick": a.quick, "schedules": a.schedule_list, "pp": a.pp_list,
                                  "micro_batches": a.m_list, "micro_batch_size": a.micro_batch_size,
                                  "seq_len": a.seq_len, "stages_per_rank": a.stages_per_rank, "warmup": a.warmup,
                                  "steps": a.steps, "threads": a.threads, "cores": cores, "extra_overrides": a.set,
                                  "load_before": load_before, "load_after": os.getloadavg()[0]},
                       "theory": {k: {"formula": f, "source": s} for k, (f, s) in THEORY.items()},
                       "launches": launches, "rows": rows}, fh, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
