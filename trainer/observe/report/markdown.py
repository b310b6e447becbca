"""report.md: one table row per run, the overrides that differ between the runs as columns, then the figures."""
from __future__ import annotations

import math
import os
from typing import Dict, List, Optional

from trainer.observe.report.plots import GIB, Plot
from trainer.observe.report.runs import Run
from trainer.observe.report.summary import Summary

COLUMNS = ("exit", "steps", "tokens", "final loss", "last val loss", "best val loss", "median tokens/s",
           "peak memory", "model states")


def render(runs: List[Run], summaries: List[Summary], keys: List[str], overrides: List[Dict[str, str]],
           out_dir: str, written: List[Plot], skipped: List[Plot]) -> str:
    root = runs[0].path if len(runs) == 1 else os.path.commonpath([r.path for r in runs])
    lines = ["# Run report", "",
             f"{len(runs)} run{'s' if len(runs) != 1 else ''} under `{root}`, written by "
             f"`python -m trainer.report`. Columns: the overrides that differ between the runs, how each run ended "
             f"(`exit`), its last logged step and target tokens, the last training loss, the last and the lowest "
             f"validation loss, the median of its logged tokens/s, the largest `peak_mem_gib` logged (CUDA "
             f"allocated, or rank 0's resident memory on CPU) and the largest rank's model states after step 1 "
             f"(`memory.json`).", ""]
    lines += table(runs, summaries, keys, overrides, out_dir)
    lines += ["", "## Figures", ""]
    for plot in written:
        lines += [f"### {plot.title}", "", f"[![{plot.title}]({plot.file})]({plot.file})", ""]
    if skipped:
        lines += ["Skipped, no run has the data:", ""]
        lines += [f"- `{plot.file}`: {plot.missing}" for plot in skipped]
    return "\n".join(lines).rstrip("\n") + "\n"


def table(runs: List[Run], summaries: List[Summary], keys: List[str], overrides: List[Dict[str, str]],
          out_dir: str) -> List[str]:
    header = ["run", *(f"`{k}`" for k in keys), *COLUMNS]
    align = ["---"] * (1 + len(keys)) + ["---"] + ["---:"] * (len(COLUMNS) - 1)
    rows = [_row(header), _row(align)]
    for run, summary, values in zip(runs, summaries, overrides):
        link = os.path.relpath(run.path, out_dir).replace(os.sep, "/")
        rows.append(_row([f"[{_cell(run.name)}]({link})", *(_cell(values[k]) for k in keys),
                          *cells(summary)]))
    return rows


def cells(s: Summary) -> List[str]:
    """A summary's values in COLUMNS' order, as the table shows them (`-`: not logged)."""
    return [_cell(s.state), _count(s.steps), _count(s.tokens), loss(s.final_loss), loss(s.last_val),
            loss(s.best_val), rate(s.median_tokens_per_s),
            size(s.peak_mem_gib * GIB if s.peak_mem_gib is not None else None), size(s.model_states_bytes)]


def loss(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.4f}" if math.isfinite(x) else "nan"


def rate(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def size(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n) -> str:
    return "-" if n is None else str(n)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _row(cells_: List[str]) -> str:
    return "| " + " | ".join(cells_) + " |"
