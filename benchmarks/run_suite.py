#!/usr/bin/env python
"""Tessera's benchmark suite: one command, one Markdown report with PNG plots.

    pip install -e '.[bench]'                        # matplotlib, for the plots (once)
    python benchmarks/run_suite.py                   # full, llama_100m: ~25 min on 2 CPU cores + pipeline / memory
    python benchmarks/run_suite.py --quick           # a debug-size model, every section but memory: 2.5-5 min
    python benchmarks/run_suite.py --quick --sections matrix,peers --strategies ddp --world-sizes 2 --peer-rows ddp
    python benchmarks/run_suite.py --sections matrix --strategies fsdp,zero3 --world-sizes 2,4

Sections (--sections, default all; the report follows this order):

  throughput   trainer vs a bare PyTorch loop, tokens/s and the ratio              (bench_throughput.py)
  matrix       every strategy at world sizes 1, 2, 4: tokens/s, per-rank memory, bytes moved by collectives per
               step vs theory (2Ψ / 3Ψ) and the time from launch to the first step, from the same runs
               (bench_collectives.py probes every rank)
  checkpoint   checkpoint save / load throughput vs the disk                         (bench_checkpoint.py)
  pipeline     pipeline bubble per schedule                                          (bench_pipeline.py)
  memory       per-rank model-state memory vs the ZeRO paper's formulas              (bench_memory.py)
  peers        Hugging Face Trainer (accelerate; DeepSpeed for ZeRO rows) vs Tessera on the same model, data,
               batch, precision and steps: single, ddp, zero2, zero3                 (bench_peers.py)

The report (report.md), its plots (*.png), every figure as JSON (results.json) and every run's log (logs/) go to
--out-dir (default outputs/bench/<date-time>/). A row that fails is reported with its error and the suite goes
on; the exit code is 0 when the report was written (--strict: 1 if any row failed).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

SECTIONS = ("throughput", "matrix", "checkpoint", "pipeline", "memory", "peers")
ALL_STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp", "hsdp", "tp", "pp",
                  "fsdp_tp", "pp_fsdp", "3d")
DEFAULTS = dict(model="llama_100m", precision="bf16", seq_len=64, global_batch=4, micro_batch=1, warmup=2, steps=3,
                world_sizes="1,2,4", strategies=",".join(ALL_STRATEGIES), peer_rows="single,ddp,zero2,zero3",
                peer_world_size=2, peer_steps=10, peer_repeats=3, sections=",".join(SECTIONS))
QUICK = dict(model="tiny", precision="bf16", seq_len=32, global_batch=2, micro_batch=1, warmup=3, steps=10,
             world_sizes="1,2", strategies="single,ddp,zero2,zero3,fsdp", peer_rows="single,ddp,zero2,zero3",
             peer_world_size=2, peer_steps=10, peer_repeats=1,
             sections="throughput,matrix,checkpoint,pipeline,peers")
QUICK_PAIRS = "single:1,ddp:2,zero2:2,zero3:2,fsdp:2"
MIB, MB = 2**20, 1e6
COLLECTIVES_TEXT = " ".join("""
Counted at the collective calls in every rank (`benchmarks/bench_collectives.py`: the torch.distributed functions
DeepSpeed, FSDP2, DDP's comm hook and pipelining call, and the functional collectives of DTensor), for one
steady-state optimizer step (the last but one; "steady" = the last step moved the same bytes), the rank that moved
the most. Conventions: **at the calls** = tensor bytes handed to the calls (all-reduce: the tensor; reduce-scatter:
its full input; all-gather: its full output); **volume** = the ZeRO paper's unit, an all-reduce counted twice
(= reduce-scatter + all-gather), shown in Ψ (elements / parameter count, whatever the dtype) and in MiB; **ring
traffic** = bytes one rank sends with ring algorithms, (N-1)/N x volume. Theory: DDP / ZeRO-1 / ZeRO-2 2Ψ, ZeRO-3 /
FSDP 3Ψ, HSDP 3Ψ within the shard group (size s) + 2Ψ/s across replicas; no single figure for tp / pp (they move
activations, which scale with batch x seq_len, not Ψ). k = micro-batches per optimizer step (gradient
accumulation); **expected at k** applies the paper's accounting per micro-batch where the strategy communicates per
micro-batch: DDP reduces once per step (no_sync): 2Ψ; ZeRO-1 (DeepSpeed) reduces the accumulated gradients once and
all-gathers the parameters once: 2Ψ; ZeRO-2 reduces every micro-batch's gradients and all-gathers once: (k+1)Ψ;
ZeRO-3 and FSDP (Tessera does not defer FSDP's reduce-scatter) gather and reduce every micro-batch: 3kΨ. The loop's
logging reduction of the loss (between steps) is left out.
""".split())
MPL_MISSING = ("run_suite: the report's plots need matplotlib, which is not installed in this environment.\n"
               "  Install the benchmark extra:  pip install -e '.[bench]'   (or: pip install matplotlib)\n"
               "  or write the report without plots:  --no-plots")


# ================================================================================================================
# Helpers
# ================================================================================================================
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fmt(v, spec=".1f", none="—") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return format(v, spec)


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "deepspeed", "accelerate", "matplotlib"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    gpus = None
    if shutil.which("nvidia-smi"):
        try:
            gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": _mem_gib(), "gpus": gpus, "commit": commit,
            "dirty": dirty, "host": platform.node()}


def _mem_gib():
    try:
        with open("/proc/meminfo") as fh:
            kb = int(next(ln for ln in fh if ln.startswith("MemTotal")).split()[1])
        return kb / 2**20
    except (OSError, StopIteration, ValueError):
        return None


def markdown_tables(text: str) -> str:
    """The Markdown tables (lines starting with '|') in a script's output, blank-line separated."""
    blocks, cur = [], []
    for ln in text.splitlines():
        if ln.startswith("|"):
            cur.append(ln)
        elif cur:
            blocks.append("\n".join(cur))
            cur = []
    if cur:
        blocks.append("\n".join(cur))
    return "\n\n".join(blocks)


def run_script(name: str, args, out_json: str, logs: str, timeout: float, env_extra=None) -> dict:
    """Run benchmarks/<name> with --out <json>; returns {"result": json or None, "stdout", "error", "wall_s"}."""
    cmd = [sys.executable, os.path.join(HERE, name), *args, "--out", out_json]
    log_path = os.path.join(logs, name.replace(".py", ".log"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env_extra or {}))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = "timeout", _text(e.stdout), _text(e.stderr)
    with open(log_path, "w") as fh:
        fh.write(f"$ {' '.join(cmd)}\n\n{stdout}\n--- stderr ---\n{stderr}")
    out = {"command": " ".join(cmd[1:]), "stdout": stdout, "wall_s": time.time() - t0, "log": log_path,
           "returncode": rc}
    if os.path.exists(out_json):
        with open(out_json) as fh:
            out["result"] = json.load(fh)
    if rc != 0:
        lines = [ln for ln in (stderr or stdout or "").strip().splitlines() if ln.strip()]
        out["error"] = f"exit {rc}: {lines[-1][:400] if lines else 'no output'}"
    return out


def _text(b):
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


# ================================================================================================================
# Plots
# ================================================================================================================
class Plots:
    def __init__(self, out_dir: str, enabled: bool):
        self.out_dir, self.enabled, self.files = out_dir, enabled, []
        if enabled:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            self.plt = plt

    def bars(self, name: str, title: str, categories, series: dict, ylabel: str, log_scale=False,
             hline=None, hline_label=None, annotate=True):
        """Grouped bars: one group per category, one bar per series (None values are left out)."""
        if not self.enabled or not categories:
            return None
        plt = self.plt
        fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 0.5 * len(categories) * max(1, len(series)) + 2)), 4.4))
        k = max(1, len(series))
        width = 0.8 / k
        for i, (label, values) in enumerate(series.items()):
            xs = [j + (i - (k - 1) / 2) * width for j in range(len(categories))]
            pts = [(x, v) for x, v in zip(xs, values) if v is not None and math.isfinite(v)]
            if not pts:
                continue
            bars = ax.bar([p[0] for p in pts], [p[1] for p in pts], width * 0.95, label=label)
            if annotate and len(pts) * k <= 40:
                ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=1)
        if hline is not None:
            ax.axhline(hline, color="k", lw=0.8, ls="--", label=hline_label)
        ax.set_xticks(range(len(categories)))
        ax.set_xticklabels(categories, rotation=30 if len(categories) > 5 else 0, ha="right" if len(categories) > 5
                           else "center", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if log_scale:
            ax.set_yscale("log")
        if len(series) > 1 or hline_label:
            ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        return self._save(fig, name)

    def stacked(self, name: str, title: str, labels, segments: dict, xlabel: str):
        """Horizontal stacked bars: one bar per label, one colour per segment."""
        if not self.enabled or not labels:
            return None
        plt = self.plt
        fig, ax = plt.subplots(figsize=(8, 0.35 * len(labels) + 1.8))
        left = [0.0] * len(labels)
        for seg, values in segments.items():
            vals = [v or 0.0 for v in values]
            ax.barh(range(len(labels)), vals, left=left, label=seg)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        handles, names = ax.get_legend_handles_labels()
        fig.legend(handles, names, fontsize=7, loc="lower center", ncol=3, frameon=False)
        return self._save(fig, name, rect=(0, 0.9 / (0.35 * len(labels) + 1.8), 1, 1))

    def _save(self, fig, name: str, rect=None) -> str:
        fig.tight_layout(rect=rect)
        path = os.path.join(self.out_dir, name)
        fig.savefig(path, dpi=110)
        self.plt.close(fig)
        self.files.append(name)
        return name


# ================================================================================================================
# The suite
# ================================================================================================================
class Suite:
    def __init__(self, a):
        self.a = a
        self.out_dir = a.out_dir
        self.logs = os.path.join(self.out_dir, "logs")
        self.work = os.path.join(self.out_dir, "runs")
        os.makedirs(self.logs, exist_ok=True)
        os.makedirs(self.work, exist_ok=True)
        self.plots = Plots(self.out_dir, not a.no_plots)
        self.results = {"config": {k: v for k, v in vars(a).items()}, "sections": {}, "section_wall_s": {},
                        "command": " ".join(["python", "benchmarks/run_suite.py", *sys.argv[1:]]),
                        "versions": versions(), "machine": machine()}
        self.notes = []  # what could not be done, and why

    # ---- shared run shape -------------------------------------------------------------------------------------
    def overrides(self, extra=()):
        import bench_collectives as BC

        a = self.a
        return BC.run_overrides(a.model, a.precision, a.seq_len, a.global_batch, a.micro_batch, a.warmup + a.steps,
                                a.quick, [*extra, *a.set])

    # ---- sections ---------------------------------------------------------------------------------------------
    def throughput(self):
        a = self.a
        args = ["--quick"] if a.quick else [
            "--model", a.model, "--precision", a.precision, "--seq-len", str(a.seq_len), "--global-batch",
            str(a.global_batch), "--micro-batch", str(a.micro_batch), "--warmup", str(a.warmup), "--steps",
            str(a.steps), "--repeats", str(a.repeats)]
        args += ["--threads", str(a.threads), "--timeout", str(a.timeout)]
        return run_script("bench_throughput.py", args, os.path.join(self.work, "throughput.json"), self.logs,
                          a.timeout * 2 * max(1, a.repeats) + 60)

    def matrix(self):
        import bench_collectives as BC

        a = self.a
        rows, skipped = [], []
        for s, n in a.matrix_pairs:
            so = BC.strategy_overrides(s, n)
            if so is None:
                skipped.append({"strategy": s, "world_size": n, "why": BC.NOT_RUN_WHY.get(s, "")})
                continue
            dp = BC.dp_degree(s, n)
            if a.global_batch % (a.micro_batch * dp):
                skipped.append({"strategy": s, "world_size": n,
                                "why": f"global batch {a.global_batch} does not divide by micro-batch x dp {dp}"})
                continue
            ov = self.overrides(so)
            r = BC.run_tessera(s, n, ov, self.work, f"{s}-n{n}", a.threads, a.timeout, log_dir=self.logs)
            row = {"strategy": s, "world_size": n, "launcher": r["launcher"], "command": r["command"],
                   "wall_s": r["wall_s"], "log": os.path.relpath(r["log"], self.out_dir), "overrides": ov,
                   "threads": a.threads}
            if "error" in r:
                row["error"] = r["error"]
                log(f"  {s:13s} N={n}: FAILED {r['error']}  ({r['wall_s']:.0f} s)")
                rows.append(row)
                continue
            row.update(BC.window_throughput(r["metrics"], a.warmup))
            row["memory"] = BC.peak_memory(r["run_dir"])
            row["num_params"] = row["memory"].get("num_params")
            row["timeline"] = BC.timeline(r["run_dir"])
            row["accum"] = a.global_batch // (a.micro_batch * dp)
            row["collectives"] = (BC.summarize(r["run_dir"], s, row["num_params"] or 0, n, so, row["accum"])
                                  if n > 1 else None)
            rows.append(row)
            c = row["collectives"]
            log(f"  {s:13s} N={n}: {row['tokens_per_s']:9.1f} tok/s | model states/rank "
                f"{_max_mib(row['memory'].get('model_states_bytes'))} MiB | peak RSS/rank "
                f"{_max_mib(row['memory'].get('peak_rss_bytes'))} MiB | "
                + (f"{c['volume_psi']:.2f}Ψ/step | " if c and "volume_psi" in c else "")
                + f"first step after {fmt(row['timeline'].get('launch_to_first_step_s'))} s  "
                  f"({r['wall_s']:.0f} s)")
            if not a.keep_runs:
                _prune_run(r["run_dir"])
        return {"rows": rows, "skipped": skipped}

    def checkpoint(self):
        a = self.a
        args = (["--quick"] if a.quick else ["--model", a.model, "--repeats", str(max(1, a.repeats))])
        args += ["--dir", self.work, "--threads", str(max(1, a.threads))]
        return run_script("bench_checkpoint.py", args, os.path.join(self.work, "checkpoint.json"), self.logs,
                          a.timeout * 3)

    def pipeline(self):
        a = self.a
        if not os.path.exists(os.path.join(HERE, "bench_pipeline.py")):
            return {"error": "benchmarks/bench_pipeline.py is not in this checkout"}
        args = ["--quick"] if a.quick else []
        args += ["--threads", "1"]
        return run_script("bench_pipeline.py", args, os.path.join(self.work, "pipeline.json"), self.logs,
                          a.timeout * 6)

    def memory(self):
        a = self.a
        args = ["--quick"] if a.quick else ["--model", a.model, "--world-sizes",
                                            ",".join(str(n) for n in a.world_size_list if n > 1) or "2"]
        return run_script("bench_memory.py", args, os.path.join(self.work, "memory.json"), self.logs,
                          a.timeout * 20)

    def peers(self):
        import bench_peers as BP

        a = self.a
        rows = BP.measure(a.peer_row_list, a.peer_world_size, a.model, a.precision, a.seq_len, a.global_batch,
                          a.micro_batch, a.warmup, a.peer_steps, a.peer_repeats, a.quick, a.threads, self.work,
                          a.timeout, a.hf_optim, a.set, log=lambda m: log(m), log_dir=self.logs)
        return {"rows": rows}

    # ---- driver -----------------------------------------------------------------------------------------------
    def run(self):
        a = self.a
        self.results["load_before"] = os.getloadavg()
        t_start = time.time()
        for name in SECTIONS:
            if name not in a.section_list:
                continue
            log(f"section {name} ...")
            t0 = time.time()
            try:
                res = getattr(self, name)()
            except Exception as e:  # noqa: BLE001 - one broken section must not lose the others
                import traceback

                res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            self.results["sections"][name] = res
            self.results["section_wall_s"][name] = time.time() - t0
            log(f"section {name} done in {time.time() - t0:.0f} s" +
                (f": {res['error']}" if isinstance(res, dict) and res.get("error") else ""))
        self.results["wall_s"] = time.time() - t_start
        self.results["load_after"] = os.getloadavg()
        report = Report(self).render()
        with open(os.path.join(self.out_dir, "report.md"), "w") as fh:
            fh.write(report)
        with open(os.path.join(self.out_dir, "results.json"), "w") as fh:
            json.dump(self.results, fh, indent=2, default=_json_default)
        if not a.keep_runs:
            shutil.rmtree(self.work, ignore_errors=True)
        return report


def _json_default(o):
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def _max_mib(values):
    vals = [v for v in (values or []) if v is not None]
    return fmt(max(vals) / MIB if vals else None)


def _prune_run(run_dir: str):
    """Keep the small files of a run (metrics, memory.json, probe, config), drop anything large."""
    for name in ("checkpoints", "hf", "tensorboard"):
        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


# ================================================================================================================
# The report
# ================================================================================================================
class Report:
    def __init__(self, suite: Suite):
        self.s, self.a, self.res, self.plots = suite, suite.a, suite.results, suite.plots
        self.lines = []
        self.cannot = []

    def w(self, *lines):
        self.lines.extend(lines)

    def img(self, name, alt):
        if name:
            self.w(f"![{alt}]({name})", "")

    def section_error(self, name) -> bool:
        sec = self.res["sections"].get(name)
        if sec is None:
            self.w("_Not run (not in --sections)._", "")
            return True
        if isinstance(sec, dict) and sec.get("error") and not sec.get("result") and not sec.get("rows"):
            self.w(f"**Failed:** `{sec['error']}`" + (f" (log: `{os.path.relpath(sec['log'], self.s.out_dir)}`)"
                                                       if sec.get("log") else ""), "")
            self.cannot.append(f"{name}: {sec['error']}")
            return True
        if isinstance(sec, dict) and sec.get("error"):
            self.w(f"**Exited with an error:** `{sec['error']}` (partial results below)", "")
            self.cannot.append(f"{name}: {sec['error']}")
        return False

    def render(self) -> str:
        a, r = self.a, self.res
        m, v = r["machine"], r["versions"]
        mode = "quick (debug-size model)" if a.quick else "full"
        self.w("# Tessera benchmark report", "",
               f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} · mode **{mode}** · total "
               f"{r['wall_s'] / 60:.1f} min · commit {m['commit']}{' (dirty)' if m['dirty'] else ''}", "",
               f"Machine: {m['cpu']}, {m['cores']} cores, {fmt(m['memory_gib'])} GiB"
               + (f", GPUs: {m['gpus']}" if m["gpus"] else ", no GPU (gloo on CPU)")
               + f"; load average before {r['load_before'][0]:.2f}, after {r['load_after'][0]:.2f}.  ",
               "Versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x) + ".", "",
               f"Run shape (every Tessera run unless a section says otherwise): model `{a.model}`"
               + (" shrunk to hidden 64 / 2 layers" if a.quick else "")
               + f", precision {a.precision}, seq_len {a.seq_len}, global batch {a.global_batch} sequences "
                 f"(micro-batch {a.micro_batch} per rank, accumulation = global / (micro x data-parallel ranks)), "
                 f"{a.warmup} warm-up + {a.steps} measured steps, {a.threads} thread(s) per rank, eval / "
                 f"checkpoints / export off, constant lr.", "",
               f"Command: `{r.get('command', '')}`", "")
        cores = m["cores"] or 1
        if any(n * a.threads > cores for n in a.world_size_list):
            self.w(f"> On this machine ({cores} cores) a world size N with N x threads > {cores} runs its ranks on "
                   f"shared cores: tokens/s there measure overhead and contention, not scaling. Launch-to-first-step "
                   f"times include the launcher and every rank's imports competing for the same cores.", "")
        self.w("Section times: " + ", ".join(f"{k} {t / 60:.1f} min" for k, t in r["section_wall_s"].items()), "")
        self.throughput()
        ok = self.matrix_tables()
        self.collectives(ok)
        self.checkpoint()
        self.launch(ok)
        self.pipeline()
        self.memory()
        self.peers()
        self.w("## What could not be measured here, and why", "")
        if self.cannot:
            self.w(*[f"- {c}" for c in self.cannot])
        else:
            self.w("- Nothing: every requested row ran.")
        if not a.no_plots:
            self.w("", f"Plots: {', '.join(self.plots.files) or 'none'}.")
        return "\n".join(self.lines) + "\n"

    # ---- 1 -------------------------------------------------------------------------------------------------------
    def throughput(self):
        self.w("## 1. Trainer vs a bare PyTorch loop", "")
        if self.section_error("throughput"):
            return
        sec = self.res["sections"]["throughput"]
        t = sec["result"]
        c = t["config"]
        self.w(f"`benchmarks/bench_throughput.py` ({sec['wall_s']:.0f} s): model `{c['model']}` "
               f"({c['num_params'] / 1e6:.2f}M params), strategy {c['strategy']}, {c['precision']}, seq_len "
               f"{c['seq_len']}, global batch {c['global_batch']} (micro {c['micro_batch']}), {c['warmup_steps']} "
               f"warm-up + {c['measured_steps']} measured steps, {c['repeats']} repeat(s), {c['threads']} thread(s); "
               f"both sides in fresh processes, same model, weights, data, optimizer.", "",
               "| | tokens/s (median) | runs | best window |", "|---|---|---|---|",
               f"| bare PyTorch loop | {t['bare_tokens_per_s']:.1f} | "
               + " ".join(f"{x['tokens_per_s']:.1f}" for x in t["runs"]["bare"])
               + f" | {t['best_window']['bare_tokens_per_s']:.1f} |",
               f"| Tessera trainer | {t['trainer_tokens_per_s']:.1f} | "
               + " ".join(f"{x['tokens_per_s']:.1f}" for x in t["runs"]["trainer"])
               + f" | {t['best_window']['trainer_tokens_per_s']:.1f} |",
               f"| **ratio trainer / bare** | **{t['ratio']:.3f}** | paired: "
               + " ".join(f"{x:.3f}" for x in t["paired_ratios"]) + f" | {t['best_window']['ratio']:.3f} |", "")
        self.img(self.plots.bars("throughput.png", "Trainer vs bare PyTorch loop (tokens/s)",
                                 ["bare PyTorch loop", "Tessera trainer"],
                                 {"tokens/s": [t["bare_tokens_per_s"], t["trainer_tokens_per_s"]]}, "tokens/s"),
                 "trainer vs bare loop")

    # ---- 2, 3, 5 -------------------------------------------------------------------------------------------------
    def matrix_tables(self):
        a = self.a
        self.w("## 2. Strategies: tokens/s and per-rank memory at each world size", "")
        if self.section_error("matrix"):
            return None
        sec = self.res["sections"]["matrix"]
        rows = sec["rows"]
        ok = [r for r in rows if "error" not in r]
        psi = next((r["num_params"] for r in ok if r.get("num_params")), None)
        self.w(f"One real training run per (strategy, N) through the launcher launch.sh picks (python / torchrun / "
               f"deepspeed), every rank started through `bench_collectives.py --probe` (it wraps the collective calls "
               f"and records timestamps and peak memory; its own bookkeeping time is in results.json, "
               f"`probe_overhead_s`). Ψ = {fmt(psi / 1e6 if psi else None, '.2f')}M parameters. "
               f"tokens/s: target tokens of the measured steps over their wall time (metrics.jsonl, one window per "
               f"step). Memory per rank, the largest rank: model states = parameters + gradients + optimizer state "
               f"(+ fp32 master) as the trainer measures them from the live tensors in step 1 (memory.json, peak over "
               f"its probe points), \"between steps\" = what stays allocated after the step; peak RSS = the "
               f"process's peak resident memory (CPU; on CUDA the peak allocated), which includes the runtime "
               f"(~0.3-0.5 GiB of Python, torch and libraries per process).", "",
               "| strategy | N | launcher | tokens/s | tokens/s per rank | step s (median) | model states / rank "
               "MiB | between steps MiB | peak RSS / rank MiB (max; all ranks) | loss (last) | run s |",
               "|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                self.w(f"| {r['strategy']} | {r['world_size']} | {r['launcher']} | failed: {r['error'][:160]} "
                       f"||||||| {r['wall_s']:.0f} |")
                self.cannot.append(f"matrix {r['strategy']} N={r['world_size']}: {r['error'][:300]} "
                                   f"(log: {r['log']})")
                continue
            mem = r["memory"]
            st = sorted(r.get("step_times_s") or [])
            med = st[len(st) // 2] if st else None
            rss = [x for x in mem.get("peak_rss_bytes") or [] if x]
            self.w(f"| {r['strategy']} | {r['world_size']} | {r['launcher']} | {r['tokens_per_s']:.1f} | "
                   f"{r['tokens_per_s'] / r['world_size']:.1f} | {fmt(med, '.3f')} | "
                   f"{_max_mib(mem.get('model_states_bytes'))} | "
                   f"{_max_mib(mem.get('model_states_between_steps_bytes'))} | {_max_mib(rss)} "
                   f"({' '.join(f'{x / MIB:.0f}' for x in rss)}) | {fmt(r.get('final_loss'), '.3f')} | "
                   f"{r['wall_s']:.0f} |")
        for s in sec["skipped"]:
            self.w(f"| {s['strategy']} | {s['world_size']} | — | not run: {s['why']} ||||||||")
        self.w("")
        strategies = [s for s in a.strategy_list if any(r["strategy"] == s for r in ok)]
        by = {(r["strategy"], r["world_size"]): r for r in ok}
        series = {f"N={n}": [by.get((s, n), {}).get("tokens_per_s") for s in strategies] for n in a.world_size_list}
        self.img(self.plots.bars("matrix_tokens.png", f"tokens/s per strategy and world size ({a.model})",
                                 strategies, series, "tokens/s"), "tokens/s per strategy")
        series = {f"N={n}": [(_maxv(by.get((s, n), {}).get("memory", {}).get("model_states_bytes")) or 0) / MIB
                             if (s, n) in by else None for s in strategies] for n in a.world_size_list}
        self.img(self.plots.bars("matrix_memory.png", "model states per rank (MiB, largest rank)", strategies,
                                 series, "MiB"), "model-state memory per rank")
        series = {f"N={n}": [(_maxv(by.get((s, n), {}).get("memory", {}).get("peak_rss_bytes")) or 0) / MIB
                             if (s, n) in by else None for s in strategies] for n in a.world_size_list}
        self.img(self.plots.bars("matrix_rss.png", "peak memory per rank (MiB, largest rank; RSS on CPU)",
                                 strategies, series, "MiB"), "peak memory per rank")
        return ok

    def collectives(self, ok):
        if ok is None:
            self.w("## 3. Bytes moved by collectives per step vs theory", "", "_From the matrix runs: the matrix "
                   "section did not run._", "")
            return
        self.w("## 3. Bytes moved by collectives per step vs theory", "", COLLECTIVES_TEXT, "")
        import bench_collectives as BC

        rows = []
        for r in ok:
            c = r.get("collectives")
            if not c or "error" in c:
                continue
            c = dict(c, world_size=r["world_size"])
            c["expected_psi"] = BC.expected_psi(c["strategy"], c.get("accum", 1), r.get("overrides"))
            c["ratio"] = c["volume_psi"] / c["expected_psi"] if c["expected_psi"] else None
            rows.append(c)
        if not rows:
            self.w("_No run at N >= 2._", "")
            return
        self.w(self._coll_table(rows), "")
        zero12 = [r for r in rows if r["strategy"] in ("zero1", "zero2") and r.get("ratio") and r["ratio"] > 1.1]
        zero3 = [r for r in rows if r["strategy"] in ("zero3", "zero3_offload") and r.get("ratio")
                 and r["ratio"] < 0.9]
        if zero12:
            self.w("- ZeRO-1/2 above the theory: DeepSpeed reduces the gradient buckets with **all-reduce** "
                   "(`DeepSpeedZeroOptimizer.average_tensor` with `use_multi_rank_bucket_allreduce`, its default), not "
                   "a reduce-scatter, then all-gathers the updated bf16 partitions: ZeRO-1 (one reduction per step) "
                   "2Ψ + Ψ = 3Ψ, ZeRO-2 (one per micro-batch) 2kΨ + Ψ, in the paper's unit.")
        if zero3:
            self.w("- ZeRO-3 below 3Ψ: DeepSpeed keeps the parameters it gathered in forward for backward when they "
                   "are reused within `stage3_max_reuse_distance` (default 1e9 elements, more than this model) and "
                   "never partitions parameters under `stage3_param_persistence_threshold` (their gradients are "
                   "all-reduced): the backward all-gather is skipped, at the cost of holding the gathered "
                   "parameters from forward to backward.")
        if zero12 or zero3:
            self.w("")
        cats = [f"{r['strategy']} N={r['world_size']} k={r.get('accum', 1)}" for r in rows]
        self.img(self.plots.bars("collectives.png", "collective volume per step per rank (units of Ψ)", cats,
                                 {"measured": [r["volume_psi"] for r in rows],
                                  "expected (paper, at k)": [r.get("expected_psi") for r in rows]}, "volume / Ψ"),
                 "collective volume vs theory")

    @staticmethod
    def _coll_table(rows) -> str:
        import bench_collectives as BC

        out = ["| strategy | N | k | measured volume | theory (k = 1) | expected at k | measured / expected | "
               "at the calls MiB | volume MiB | ring traffic / rank MiB | calls | steady | by collective (volume, "
               "dtypes, calls) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            psi = r["psi"]
            kinds = "; ".join(
                f"{k} {BC.VOLUME_FACTOR.get(k, 1.0) * x['elements'] / psi:.2f}Ψ ({'/'.join(x['dtypes'])}, "
                f"{x['calls']}x)" for k, x in sorted(r["by_kind"].items(), key=lambda kv: -kv[1]["elements"]))
            theory = f"{r['theory_text']} = {r['theory_psi']:.2f}Ψ" if r.get("theory_psi") else "—"
            expected = f"{r['expected_psi']:.2f}Ψ" if r.get("expected_psi") else "—"
            steady = {True: "yes", False: "no", None: "—"}[r.get("steady")]
            out.append(f"| {r['strategy']} | {r['world_size']} | {r.get('accum', 1)} | {r['volume_psi']:.3f}Ψ | "
                       f"{theory} | {expected} | {fmt(r.get('ratio'), '.3f')} | {r['bytes_at_calls'] / MIB:.1f} | "
                       f"{r['volume_bytes'] / MIB:.1f} | {r['ring_bytes'] / MIB:.1f} | {r['calls']} | {steady} | "
                       f"{kinds} |")
        return "\n".join(out)

    def launch(self, ok):
        if ok is None:
            self.w("## 5. Time from launch to the first step", "", "_From the matrix runs: the matrix section did "
                   "not run._", "")
            return
        self.w("## 5. Time from launch to the first step", "",
               "From the moment the suite starts the launcher (`TESSERA_BENCH_T0`) to the end of the first optimizer "
               "step on the slowest rank (the probe's timestamps, wall clock). Segments (rank 0): launcher + "
               "interpreter start (incl. the launcher's own imports and the rank spawn), imports + Hydra config, "
               "`trainer.build.prepare` (checks, tokenizer, data), `trainer.build.build` (process group, model, "
               "strategy, optimizer), first step.", "",
               "| strategy | N | launcher | launch → first step s | launcher + interpreter | imports + config | "
               "checks + tokenizer + data | process group + model + strategy | first step |",
               "|---|---|---|---|---|---|---|---|---|")
        segs = ("launcher + interpreter", "imports + config", "checks + tokenizer + data",
                "process group + model + strategy", "first step")
        labels, data = [], {s: [] for s in segs}
        for r in ok:
            t = r.get("timeline") or {}
            g = t.get("segments", {})
            self.w(f"| {r['strategy']} | {r['world_size']} | {r['launcher']} | "
                   f"{fmt(t.get('launch_to_first_step_s'))} | " + " | ".join(fmt(g.get(s)) for s in segs) + " |")
            labels.append(f"{r['strategy']} N={r['world_size']}")
            for s in segs:
                data[s].append(g.get(s))
        self.w("")
        self.img(self.plots.stacked("launch.png", "launch → first optimizer step (s)", labels, data, "seconds"),
                 "launch to first step")

    # ---- 4 -------------------------------------------------------------------------------------------------------
    def checkpoint(self):
        self.w("## 4. Checkpoint save / load throughput vs the disk", "")
        if self.section_error("checkpoint"):
            return
        sec = self.res["sections"]["checkpoint"]
        c = sec["result"]
        d, b, mdl = c["disk"], c["blocking"], c["model"]
        self.w(f"`benchmarks/bench_checkpoint.py` ({sec['wall_s']:.0f} s; strategy single, AdamW state; "
               f"checkpoint {mdl['checkpoint_bytes'] / MB:.1f} MB). MB = 10^6 bytes; medians; see "
               f"benchmarks/README.md for how the disk is measured (fsync, page-cache eviction).", "",
               "| | MB/s | vs disk |", "|---|---|---|",
               f"| disk write (fsync) | {d['write_mb_s']:.0f} | 1.00 |",
               f"| disk read, cold | {d['read_cold_mb_s']:.0f} | 1.00 |",
               f"| checkpoint save (sync) | {c['save_mb_s']:.0f} | {c['save_mb_s'] / d['write_mb_s']:.2f} of write |",
               f"| checkpoint load, cold | {c['load_mb_s']:.0f} | {c['load_mb_s'] / d['read_cold_mb_s']:.2f} of read |",
               f"| checkpoint load, page cache | {c['load_cached_mb_s']:.0f} | "
               f"{c['load_cached_mb_s'] / d['read_cached_mb_s']:.2f} of cached read |", "",
               f"A save blocks the step {b['sync_blocking_s']:.3f} s (sync) vs {b['async_blocking_s']:.3f} s "
               f"(async_save=true).", "")
        self.img(self.plots.bars("checkpoint.png", "checkpoint throughput vs disk (MB/s)",
                                 ["write / save", "read cold / load cold"],
                                 {"disk": [d["write_mb_s"], d["read_cold_mb_s"]],
                                  "checkpoint": [c["save_mb_s"], c["load_mb_s"]]}, "MB/s"), "checkpoint vs disk")

    # ---- 6 -------------------------------------------------------------------------------------------------------
    def pipeline(self):
        self.w("## 6. Pipeline bubble per schedule", "")
        if self.section_error("pipeline"):
            return
        sec = self.res["sections"]["pipeline"]
        self.w(f"`benchmarks/bench_pipeline.py` ({sec['wall_s']:.0f} s; its own model and settings, see its "
               f"README section). Its table:", "", markdown_tables(sec.get("stdout", "")) or "_(no table printed)_", "")
        rows = [r for r in (sec.get("result") or {}).get("rows", []) if "skipped" not in r and "idle_mean" in r]
        if rows:
            cats = [f"{r['schedule']} p={r.get('pp')} m={r.get('micro_batches')}" for r in rows]
            self.img(self.plots.bars("pipeline.png", "pipeline bubble (idle fraction) per schedule", cats,
                                     {"measured idle": [r["idle_mean"] for r in rows],
                                      "theory": [r.get("theory") for r in rows]}, "idle fraction"),
                     "pipeline bubble")

    # ---- 7 -------------------------------------------------------------------------------------------------------
    def memory(self):
        self.w("## 7. Per-rank model-state memory vs the ZeRO formulas", "")
        if self.section_error("memory"):
            return
        sec = self.res["sections"]["memory"]
        self.w(f"`benchmarks/bench_memory.py` ({sec['wall_s']:.0f} s; its own run shape: precision bf16, seq_len "
               f"32, global batch N, one step). Its table:", "",
               markdown_tables(sec.get("stdout", "")) or "_(no table printed)_", "")

    # ---- 8 -------------------------------------------------------------------------------------------------------
    def peers(self):
        import bench_peers as BP

        a = self.a
        self.w("## 8. Peer comparison: Hugging Face Trainer vs Tessera", "")
        if self.section_error("peers"):
            return
        sec = self.res["sections"]["peers"]
        rows = sec["rows"]
        optims = sorted({x["optim"] for r in rows for x in r["runs"]["hf"] if x.get("optim")}) or [a.hf_optim]
        self.w(f"`benchmarks/bench_peers.py`: the same model (models.registry, same seeded weights), data (the same "
               f"packed sequences, seq_len {a.seq_len}), global batch {a.global_batch} (micro {a.micro_batch}), "
               f"precision per row, {a.warmup} warm-up + {a.peer_steps} measured steps, {a.peer_repeats} repeat(s) "
               f"per side (order alternating), AdamW with the same "
               f"hyper-parameters and kernel (HF `optim={'/'.join(optims)}`: torch's AdamW kernel that Tessera's "
               f"`optim.implementation` picks), clipping, constant lr, {a.threads} "
               f"thread(s) per rank; ddp / zero rows at N = {a.peer_world_size}; Tessera and HF back to back per row. "
               f"HF: `transformers.Trainer` + accelerate; the ZeRO rows pass `TrainingArguments(deepspeed=<the "
               f"DeepSpeed config Tessera generates for the row>)`. tokens/s = the median measured step's target "
               f"tokens / its wall time, step end to step end, over all repeats of a side (a stall of the shared "
               f"machine moves one step, not the figure); the interval is a 95% bootstrap of the ratio (runs "
               f"resampled, then their steps), and the target column says 'met' when all of it is >= 1, 'not met' "
               f"when all of it is < 1, else 'within noise'; 'per repeat' is each back-to-back pair's ratio of "
               f"whole-run tokens/s. The collective bytes (one step, the paper's "
               f"volume, the busiest rank) are counted by the same probe on both sides: equal bytes mean the same "
               f"communication.", "", BP.table(rows), "")
        for r in rows:
            for side, err in r["errors"].items():
                self.cannot.append(f"peers {r['row']} ({side}): {err}")
        if rows:
            by = {v: [r["row"] for r in rows if r.get("verdict") == v] for v in ("met", "within noise", "not met")}
            self.w("Target: Tessera / HF >= 1 on every row. " + "; ".join(
                f"{v}: {', '.join(names)}" for v, names in by.items() if names) + ".", "")
        ok = [r for r in rows if r["tessera_tokens_per_s"] or r["hf_tokens_per_s"]]
        self.img(self.plots.bars("peers.png", "Tessera vs HF Trainer (tokens/s)",
                                 [f"{r['row']} N={r['world_size']}" for r in ok],
                                 {"Tessera": [r["tessera_tokens_per_s"] for r in ok],
                                  "HF Trainer": [r["hf_tokens_per_s"] for r in ok]}, "tokens/s"), "peers")


def _maxv(values):
    vals = [x for x in (values or []) if x is not None]
    return max(vals) if vals else None


# ================================================================================================================
# CLI
# ================================================================================================================
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true",
                    help="debug-size model (hidden 64, 2 layers), single at N = 1 and four strategies at N = 2, short "
                         "runs; the memory section is left out unless named")
    ap.add_argument("--sections", help=f"comma-separated, of {', '.join(SECTIONS)} (default all)")
    ap.add_argument("--model", help="preset in conf/model (default llama_100m; --quick: tiny, shrunk)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), help="default bf16")
    ap.add_argument("--strategies", help="matrix strategies, comma-separated (default all 13)")
    ap.add_argument("--world-sizes", help="matrix world sizes (default 1,2,4)")
    ap.add_argument("--pairs", help=f"explicit matrix runs strategy:N, comma-separated, instead of strategies x world "
                                    f"sizes (--quick without --strategies / --world-sizes: {QUICK_PAIRS})")
    ap.add_argument("--seq-len", type=int, help="default 64 (--quick 32)")
    ap.add_argument("--global-batch", type=int, help="sequences per optimizer step (default 4; --quick 2, so that "
                                                     "N = 2 runs one micro-batch per step)")
    ap.add_argument("--micro-batch", type=int, help="sequences per rank per forward (default 1)")
    ap.add_argument("--warmup", type=int, help="steps not measured (default 2; --quick 3)")
    ap.add_argument("--steps", type=int, help="measured steps (default 3; --quick 10)")
    ap.add_argument("--repeats", type=int, default=1, help="repeats of the throughput / checkpoint "
                                                           "measurements (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank (default 1: no rank "
                                                           "oversubscribes a core, stable on a shared machine)")
    ap.add_argument("--peer-rows", help="of single,ddp,zero2,zero3 (default all)")
    ap.add_argument("--peer-world-size", type=int, help="ranks of the ddp / zero peer rows (default 2)")
    ap.add_argument("--peer-steps", type=int, help="measured steps of each peer run (default 10)")
    ap.add_argument("--peer-repeats", type=int, help="peer runs per side, order alternating (default 3; --quick 1)")
    ap.add_argument("--hf-optim", default="match", help="the HF Trainer's optim (default match: the torch AdamW "
                                                        "kernel Tessera uses, fused on CPU and CUDA)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Hydra override for every matrix and peer run")
    ap.add_argument("--out-dir", help="default outputs/bench/<date-time>")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run (default 900; --quick 300)")
    ap.add_argument("--keep-runs", action="store_true", help="keep every run directory under <out-dir>/runs")
    ap.add_argument("--no-plots", action="store_true", help="write the report without PNG plots (no matplotlib)")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any row or section failed")
    ap.add_argument("--report-only", metavar="DIR",
                    help="write DIR/report.md and its plots again from DIR/results.json; runs nothing")
    a = ap.parse_args(argv)
    if a.pairs is None and a.quick and a.strategies is None and a.world_sizes is None:
        a.pairs = QUICK_PAIRS
    base = QUICK if a.quick else DEFAULTS
    for k, v in base.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.timeout is None:
        a.timeout = 300.0 if a.quick else 900.0
    a.section_list = [s for s in a.sections.split(",") if s]
    a.strategy_list = [s for s in a.strategies.split(",") if s]
    a.world_size_list = [int(n) for n in a.world_sizes.split(",") if n]
    a.peer_row_list = [r for r in a.peer_rows.split(",") if r]
    if a.pairs:
        try:
            a.matrix_pairs = [(x.split(":")[0], int(x.split(":")[1])) for x in a.pairs.split(",") if x]
        except (IndexError, ValueError):
            ap.error(f"--pairs: expected strategy:N,... (got {a.pairs!r})")
        a.strategy_list = list(dict.fromkeys(st for st, _ in a.matrix_pairs))
        a.world_size_list = sorted({n for _, n in a.matrix_pairs})
    else:
        a.matrix_pairs = [(st, n) for n in a.world_size_list for st in a.strategy_list]
    bad = ([s for s in a.section_list if s not in SECTIONS] + [s for s in a.strategy_list if s not in ALL_STRATEGIES]
           + [r for r in a.peer_row_list if r not in ("single", "ddp", "zero2", "zero3")])
    if bad:
        ap.error(f"unknown section / strategy / peer row: {', '.join(bad)}")
    if a.warmup < 1 or a.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    if a.out_dir is None:
        a.out_dir = os.path.join(ROOT, "outputs", "bench", datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if not a.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(MPL_MISSING, file=sys.stderr)
            return 2
    if a.report_only:
        return report_only(a.report_only, a.no_plots)
    os.makedirs(a.out_dir, exist_ok=True)
    log(f"Tessera benchmark suite ({'quick' if a.quick else 'full'}): sections {', '.join(a.section_list)} -> "
        f"{a.out_dir}")
    suite = Suite(a)
    suite.run()
    rep = os.path.join(a.out_dir, "report.md")
    log(f"report: {rep} ({suite.results['wall_s'] / 60:.1f} min)")
    failed = _any_failure(suite.results)
    if failed:
        log("some rows or sections failed: see 'What could not be measured' in the report")
    return 1 if (failed and a.strict) else 0


def report_only(out_dir: str, no_plots: bool) -> int:
    """Render the report again from a finished run's results.json (with the run's own options)."""
    with open(os.path.join(out_dir, "results.json")) as fh:
        results = json.load(fh)
    a = argparse.Namespace(**results["config"])
    a.out_dir, a.no_plots = out_dir, no_plots
    suite = Suite.__new__(Suite)
    suite.a, suite.out_dir, suite.results, suite.notes = a, out_dir, results, []
    suite.plots = Plots(out_dir, not no_plots)
    with open(os.path.join(out_dir, "report.md"), "w") as fh:
        fh.write(Report(suite).render())
    log(f"report: {os.path.join(out_dir, 'report.md')} (from results.json)")
    return 0


def _any_failure(res) -> bool:
    for name, sec in res["sections"].items():
        if not isinstance(sec, dict):
            continue
        if sec.get("error"):
            return True
        for r in sec.get("rows", []) if isinstance(sec.get("rows"), list) else []:
            if r.get("error") or r.get("errors"):
                return True
    return False


if __name__ == "__main__":
    sys.exit(main())
