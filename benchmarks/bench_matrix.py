#!/usr/bin/env python
"""Strategy x world-size matrix: tokens/s, collective bytes per step vs theory, per-rank model-state memory,
launch time, checkpoint save rate and (pipeline rows) the measured bubble, one real training run per cell.

    python benchmarks/bench_matrix.py                                   # llama_100m bf16; 7 strategies at N = 1, 2, 4
    python benchmarks/bench_matrix.py --strategies ddp,fsdp --world-sizes 2,4 --out /tmp/matrix.json
    python benchmarks/bench_matrix.py --quick                           # debug-size model; ddp, zero2, zero3, fsdp, pp at N = 2

See benchmarks/README.md for what each figure means and how it is measured.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

FULL = dict(model="llama_100m", precision="bf16", seq_len=64, global_batch=4, micro_batch=1, warmup=4, steps=3)
QUICK = dict(model="tiny", precision="fp32", seq_len=32, global_batch=2, micro_batch=1, warmup=4, steps=3)
STRATEGIES = "single,ddp,zero1,zero2,zero3,fsdp,tp,pp"
QUICK_STRATEGIES = "ddp,zero2,zero3,fsdp,pp"
# The ZeRO paper's communication volume per step, in Ψ (parameter count) elements, at one micro-batch per step.
THEORY_PSI = {"ddp": 2.0, "zero1": 2.0, "zero2": 2.0, "zero3": 3.0, "zero3_offload": 3.0, "fsdp": 3.0}
# The smallest real instance of a strategy at world size n: extra degrees, or None where it cannot exist.
DEGREES = {
    "single": lambda n: [] if n == 1 else None,
    "tp": lambda n: [] if n >= 2 else None,
    "pp": lambda n: [] if n >= 2 else None,
    "hsdp": lambda n: ["strategy.dp_shard=2"] if n >= 4 and n % 2 == 0 else None,
    "fsdp_tp": lambda n: ["strategy.tp=2"] if n >= 4 and n % 2 == 0 else None,
    "pp_fsdp": lambda n: ["strategy.pp=2"] if n >= 4 and n % 2 == 0 else None,
    "3d": lambda n: ["strategy.pp=2", "strategy.tp=2"] if n >= 4 and n % 4 == 0 else None,
}
SAVED = re.compile(r"saved checkpoint \S+ \(([\d.]+) MiB in ([\d.]+)s\)")


def collectives(records, num_params: int, strategy: str) -> dict:
    """Rank 0's bytes at the calls in the last logged step (the trainer's comm_bytes), the paper's volume (an
    all-reduce counts twice) in bytes and in Ψ (fp32 elements), and whether the step before moved the same."""
    counted = [r for r in records if r.get("comm_bytes_by_kind") is not None]
    if not counted:
        return None
    last = counted[-1]["comm_bytes_by_kind"]
    volume = sum(v * (2 if k == "all_reduce" else 1) for k, v in last.items())
    return {"bytes_at_calls": counted[-1]["comm_bytes"], "by_kind": last, "volume_bytes": volume,
            "volume_psi": volume / 4 / num_params, "theory_psi": THEORY_PSI.get(strategy),
            "steady": (counted[-2]["comm_bytes_by_kind"] == last) if len(counted) > 1 else None}


def memory(report) -> dict:
    """Largest rank's model states and the largest figure of each category memory.json has."""
    if not report or not report.get("ranks"):
        return None
    ranks = report["ranks"]
    categories = ("params", "master_params", "optimizer", "grads", "gathered", "model_states")
    return {c: max(r.get(c, 0) or 0 for r in ranks) for c in categories if any(c in r for r in ranks)}


def bubble(probes, pp: int, micro_batches: int, schedule: str) -> dict:
    """Idle share of the pipeline's span (first compute start to last compute end over every rank) averaged
    over ranks, from the times each rank spent in its stage's forward / backward calls in one step."""
    profiles = [p["profile"] for p in probes if p and p.get("profile") and p["profile"]["compute_start"]]
    if len(profiles) != pp:
        return None
    span = max(p["compute_end"] for p in profiles) - min(p["compute_start"] for p in profiles)
    idle = [1 - p["compute_busy_s"] / span for p in profiles]
    theory = (pp - 1) / (micro_batches + pp - 1) if schedule in ("gpipe", "1f1b") else None
    return {"schedule": schedule, "micro_batches": micro_batches, "span_s": span, "idle_per_rank": idle,
            "idle": sum(idle) / len(idle), "theory": theory}


def measure(a, strategy: str, n: int, work: str) -> dict:
    row = {"strategy": strategy, "world_size": n}
    degrees = DEGREES.get(strategy, lambda _: [])(n)
    if degrees is None:
        return {**row, "not_run": "no instance of this strategy at this world size"}
    overrides = [*C.shape_overrides(a), f"strategy={strategy}", *degrees, "logging.memory_report=true",
                 "logging.comm_bytes=true", "checkpoint.at_end=true"]  # comm_bytes: collectives()
    cfg = C.compose(overrides)
    pp = n if strategy == "pp" else 1
    micro_batches = a.global_batch // (a.micro_batch * _dp(strategy, n))  # per rank per step
    env = C.thread_env(a.threads)
    profile = strategy == "pp"
    env["TESSERA_BENCH_PROFILE_STEP"] = str(a.warmup if profile else 0)
    run = C.run_trainer(overrides, n, os.path.join(work, f"{strategy}-{n}"), env, a.timeout, probe=True)
    first = next(r for r in run["metrics"] if r["step"] == 1)
    num_params = (run["memory"] or {}).get("num_params") or _num_params(run["output"])
    saved = SAVED.search(run["output"])
    row.update(launcher=run["launcher"], accumulation=micro_batches, num_params=num_params,
               tokens_per_s=C.tokens_per_s(run["metrics"], a.warmup),
               launch_to_first_step_s=first["time"] - run["launch_time"],
               collectives=collectives(run["metrics"], num_params, strategy) if n > 1 else None,
               memory=memory(run["memory"]),
               checkpoint={"mib": float(saved.group(1)), "seconds": float(saved.group(2))} if saved else None,
               pipeline=bubble(run["probes"], pp, micro_batches, cfg.strategy.pp_schedule) if profile else None)
    return row


def _dp(strategy: str, n: int) -> int:
    return {"tp": 1, "pp": 1, "fsdp_tp": n // 2, "pp_fsdp": n // 2, "3d": n // 4}.get(strategy, n)


def _num_params(output: str) -> int:
    m = re.search(r"([\d.]+)M params", output)
    return int(float(m.group(1)) * 1e6) if m else 0


def report(a, rows) -> str:
    def ratio(row):
        c = row.get("collectives")
        if not c:
            return "—", "—"
        theory = f"{c['theory_psi']:.0f}Ψ" if c["theory_psi"] else "—"
        return f"{c['volume_psi']:.3f}Ψ = {C.mib(c['volume_bytes'])} MiB" + ("" if c["steady"] is not False
                                                                            else " (not steady)"), theory

    table = []
    for r in rows:
        if "tokens_per_s" not in r:
            table.append([r["strategy"], r["world_size"], r.get("not_run") or f"failed: {r['error'][:150]}",
                          *[""] * 7])
            continue
        moved, theory = ratio(r)
        m, ck, pl = r["memory"] or {}, r["checkpoint"], r["pipeline"]
        table.append([r["strategy"], r["world_size"], f"{r['tokens_per_s']:.0f}", moved, theory,
                      C.mib(m.get("model_states")), f"{r['launch_to_first_step_s']:.1f}",
                      f"{ck['mib'] / ck['seconds']:.0f}" if ck and ck["seconds"] else "—",
                      f"{pl['idle']:.2f} (theory {pl['theory']:.2f})" if pl and pl["theory"] is not None else "—",
                      r["launcher"]])
    return C.markdown_table(["strategy", "N", "tokens/s", "collective volume / step", "theory",
                             "model states MiB (largest rank)", "launch → step 1 s", "ckpt save MiB/s",
                             "pipeline idle", "launcher"], table)


def main(argv=None) -> int:
    ap = C.shape_parser(__doc__, FULL, QUICK)
    ap.add_argument("--strategies", help=f"comma list (default {STRATEGIES}; --quick {QUICK_STRATEGIES})")
    ap.add_argument("--world-sizes", help="comma list (default 1,2,4; --quick 2)")
    ap.add_argument("--keep", action="store_true", help="keep the run folders and logs")
    a = C.finish_shape(ap, ap.parse_args(argv))
    if a.warmup < 4:
        ap.error("--warmup must be >= 4 (warm-up steps 3.. are counted or profiled, never measured)")
    strategies = (a.strategies or (QUICK_STRATEGIES if a.quick else STRATEGIES)).split(",")
    known = sorted(f[:-5] for f in os.listdir(os.path.join(C.REPO, "conf", "strategy")) if f.endswith(".yaml"))
    unknown = [s for s in strategies if s not in known]
    if unknown:
        ap.error(f"unknown strategies {unknown} (known: {', '.join(known)})")
    try:
        sizes = [int(x) for x in (a.world_sizes or ("2" if a.quick else "1,2,4")).split(",")]
    except ValueError:
        ap.error("--world-sizes takes a comma list of integers")
    work = tempfile.mkdtemp(prefix="tessera-matrix-")
    rows = []
    try:
        for n in sizes:
            for s in strategies:
                print(f"[{s} N={n}] ...", flush=True)
                try:
                    rows.append(measure(a, s, n, work))
                except (C.RunFailed, AssertionError) as e:
                    rows.append({"strategy": s, "world_size": n, "error": str(e)})
                print(f"[{s} N={n}] " + (rows[-1].get("not_run") or rows[-1].get("error") or
                                         f"{rows[-1]['tokens_per_s']:.0f} tok/s"), flush=True)
    finally:
        if a.keep:
            print(f"runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + report(a, rows))
    C.write_json(a.out, {"config": {k: getattr(a, k) for k in (*FULL, "threads", "set")}, "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
