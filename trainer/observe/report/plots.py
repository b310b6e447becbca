"""The report's figures: one PNG per quantity, every run a line of its own colour. Drawn on matplotlib's Agg canvas
through its object API (no pyplot, no display, no global backend state)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from trainer.observe.report.output import remove_stale, write_atomic
from trainer.observe.report.runs import Run
from trainer.observe.report.summary import largest_rank, number, val_records

try:
    from matplotlib import colormaps
    from matplotlib.figure import Figure
except ImportError:  # optional dependency (tessera[report]): the command says what to install
    colormaps = Figure = None

MIB, GIB = 2**20, 2**30

# (label suffix, x values, y values, dashed): the lines one run adds to a figure
Series = Tuple[str, List[float], List[float], bool]


def available() -> bool:
    return Figure is not None


@dataclass(frozen=True)
class Plot:
    file: str
    title: str
    xlabel: str
    ylabel: str
    series: Optional[Callable[[Run], List[Series]]]  # a run's lines (None: memory.json's bars)
    missing: str  # why it is skipped when no run has the data


def _points(records, x_key: str, y_key: str, scale: float = 1.0) -> Tuple[List[float], List[float]]:
    xs, ys = [], []
    for r in records:
        x = number(r[x_key]) if x_key in r else None
        y = number(r[y_key]) if y_key in r else None
        if x is None or y is None or math.isnan(x):
            continue
        xs.append(x)
        ys.append(y / scale)  # nan (a non-finite value logged as null) leaves a gap in the line
    return xs, ys


def _metric(key: str, x_key: str = "step", scale: float = 1.0):
    def series(run: Run) -> List[Series]:
        xs, ys = _points(run.metrics, x_key, key, scale)
        return [("", xs, ys, False)] if xs else []
    return series


def _val(x_key: str):
    def series(run: Run) -> List[Series]:
        records = val_records(run)
        if x_key == "tokens":  # eval.jsonl has steps only: the tokens trained by that step (0 before the first)
            tokens = {0: 0, **{r["step"]: r.get("tokens") for r in run.metrics}}
            records = [{**r, "tokens": tokens.get(r["step"])} for r in records]
        xs, ys = _points(records, x_key, "val_loss")
        return [("", xs, ys, True)] if xs else []
    return series


def _tasks(run: Run) -> List[Series]:
    """data=mixture: each task's training loss (solid) and validation loss (dashed)."""
    out = []
    for name in _task_names(run.metrics, "tasks"):
        rows = [{"step": r["step"], "loss": _dict(r, "tasks")[name].get("loss")} for r in run.metrics
                if isinstance(_dict(r, "tasks").get(name), dict)]
        out.append((f" {name}", *_points(rows, "step", "loss"), False))
    evals = val_records(run)
    for name in _task_names(evals, "val_loss_by_task"):
        rows = [{"step": r["step"], "loss": _dict(r, "val_loss_by_task")[name]} for r in evals
                if name in _dict(r, "val_loss_by_task")]
        out.append((f" {name} (val)", *_points(rows, "step", "loss"), True))
    return [s for s in out if s[1]]


def _dict(record: dict, key: str) -> dict:
    value = record.get(key)
    return value if isinstance(value, dict) else {}


def _task_names(records, key: str) -> List[str]:
    return list(dict.fromkeys(name for r in records for name in _dict(r, key)))


PLOTS = (
    Plot("train_loss_by_step.png", "Training loss by step", "step", "training loss", _metric("loss"),
         "no run logged a training step"),
    Plot("train_loss_by_tokens.png", "Training loss by tokens", "target tokens", "training loss",
         _metric("loss", "tokens"), "no run logged a training step with tokens"),
    Plot("val_loss_by_step.png", "Validation loss by step", "step", "validation loss", _val("step"),
         "no run was evaluated (eval.every, eval.at_end)"),
    Plot("val_loss_by_tokens.png", "Validation loss by tokens", "target tokens", "validation loss",
         _val("tokens"), "no run was evaluated (eval.every, eval.at_end)"),
    Plot("task_loss_by_step.png", "Loss per task by step (dashed: validation)", "step", "loss", _tasks,
         "no run logged per-task losses (data=mixture)"),
    Plot("tokens_per_s_by_step.png", "Throughput by step", "step", "target tokens/s", _metric("tokens_per_s"),
         "no run logged tokens_per_s"),
    Plot("peak_memory_by_step.png", "Peak memory by step (CUDA allocated, or RSS on CPU)", "step", "GiB",
         _metric("peak_mem_gib"), "no run logged peak_mem_gib"),
    Plot("comm_bytes_by_step.png", "Collective bytes per step", "step", "MiB per step",
         _metric("comm_bytes", scale=MIB), "no run logged comm_bytes (logging.comm_bytes=true)"),
)
MODEL_STATES = Plot("model_states.png", "Model states per rank after step 1 (memory.json, largest rank)", "",
                    "MiB", None, "no run has memory.json (logging.memory_report=true)")
CATEGORIES = ("params", "grads", "optimizer", "master_params", "gathered")


def write_plots(runs: List[Run], out_dir: str) -> Tuple[List[Plot], List[Plot]]:
    """Every figure that some run has data for, written into `out_dir`; (written, skipped)."""
    written, skipped = [], []
    for plot in PLOTS + (MODEL_STATES,):
        fig = _line_figure(plot, runs) if plot.series else _model_states_figure(runs)
        path = os.path.join(out_dir, plot.file)
        if fig is None:
            remove_stale(path)
            skipped.append(plot)
            continue
        write_atomic(path, lambda fh, fig=fig: fig.savefig(fh, format="png", dpi=100))
        written.append(plot)
    return written, skipped


def _colours(n: int) -> List[str]:
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    cmap = colormaps["viridis"]
    return [cmap(i / (n - 1)) for i in range(n)]


def _line_figure(plot: Plot, runs: List[Run]) -> Optional[Figure]:
    drawn = [(run, plot.series(run)) for run in runs]
    if not any(series for _, series in drawn):
        return None
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    for colour, (run, series) in zip(_colours(len(runs)), drawn):
        for suffix, xs, ys, dashed in series:
            lone = sum(1 for y in ys if not math.isnan(y)) < 2  # a single point shows only as a marker
            ax.plot(xs, ys, color=colour, linestyle="--" if dashed else "-",
                    marker="o" if dashed or lone else None, markersize=4, label=run.name + suffix)
    ax.set_title(plot.title)
    ax.set_xlabel(plot.xlabel)
    ax.set_ylabel(plot.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _model_states_figure(runs: List[Run]) -> Optional[Figure]:
    """Grouped bars: per memory-report category, each run's largest rank."""
    with_memory = [(run, largest_rank(run)) for run in runs]
    with_memory = [(run, rank) for run, rank in with_memory if rank]
    if not with_memory:
        return None
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(with_memory)
    for i, (colour, (run, rank)) in enumerate(zip(_colours(len(with_memory)), with_memory)):
        xs = [c + (i - (len(with_memory) - 1) / 2) * width for c in range(len(CATEGORIES))]
        sizes = [rank.get(c) if isinstance(rank.get(c), (int, float)) else 0 for c in CATEGORIES]
        ax.bar(xs, [b / MIB for b in sizes], width, color=colour, label=run.name)
    ax.set_xticks(range(len(CATEGORIES)), CATEGORIES)
    ax.set_title(MODEL_STATES.title)
    ax.set_ylabel(MODEL_STATES.ylabel)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")
    return fig

