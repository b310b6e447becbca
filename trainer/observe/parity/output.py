"""What a parity check writes: the table printed to stdout, parity.md and parity.json, and parity.png (both curves
and the relative differences on a log scale), each written whole or not at all (a temporary file, then a rename)."""
from __future__ import annotations

import io
import json
import math
import os
from typing import List, Optional

from trainer.observe.parity.compare import Comparison
from trainer.observe.parity.sides import Side
from trainer.observe.report.output import write_atomic

try:
    from matplotlib.figure import Figure
except ImportError:  # optional dependency (tessera[report]): without it the check writes no figure, and says so
    Figure = None

HEADER = ("step", "loss A", "loss B", "rel diff", "grad_norm A", "grad_norm B", "rel diff")


def _num(x: Optional[float], fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def table(comparison: Comparison) -> List[str]:
    """The per-step table, then the largest differences."""
    lines = ["{:>5} {:>12} {:>12} {:>9} {:>12} {:>12} {:>9}".format(*HEADER)]
    for r in comparison.rows:
        lines.append(f"{r.step:>5} {_num(r.loss_a, '.7f'):>12} {_num(r.loss_b, '.7f'):>12} "
                     f"{_num(r.loss_diff, '.2e'):>9} {_num(r.grad_norm_a, '.7f'):>12} "
                     f"{_num(r.grad_norm_b, '.7f'):>12} {_num(r.grad_norm_diff, '.2e'):>9}")
    lines.append(f"{'max':>5} {'':>12} {'':>12} {_num(comparison.max_loss_diff, '.2e'):>9} {'':>12} {'':>12} "
                 f"{_num(comparison.max_grad_norm_diff, '.2e'):>9}")
    return lines


def verdict(comparison: Comparison, a: Side, b: Side) -> str:
    word = "PASS" if comparison.passed else "FAIL"
    return (f"parity {word}: max relative loss difference {comparison.max_loss_diff:.2e}, gradient norm "
            f"{_num(comparison.max_grad_norm_diff, '.2e')} (tolerance {comparison.tolerance:g}, {a.precision} vs "
            f"{b.precision})")


def markdown(comparison: Comparison, a: Side, b: Side, notes: List[str], figure: Optional[str]) -> str:
    rows = ["| " + " | ".join(HEADER) + " |", "|" + "---:|" * len(HEADER)]
    for r in comparison.rows:
        rows.append(f"| {r.step} | {_num(r.loss_a, '.7f')} | {_num(r.loss_b, '.7f')} | {_num(r.loss_diff, '.2e')} | "
                    f"{_num(r.grad_norm_a, '.7f')} | {_num(r.grad_norm_b, '.7f')} | "
                    f"{_num(r.grad_norm_diff, '.2e')} |")
    parts = ["# Parity check", "", f"- side A (reference, run dir `a/`): {a.describe()}",
             f"- side B (run dir `b/`): {b.describe()}", *[f"- {n}" for n in notes], "",
             f"**{verdict(comparison, a, b)}**", "", *rows, ""]
    if figure:
        parts += [f"![loss, gradient norm and their relative differences]({figure})", ""]
    return "\n".join(parts)


def as_json(comparison: Comparison, a: Side, b: Side, notes: List[str]) -> dict:
    def finite(x):  # JSON has no inf / nan: null, as metrics.jsonl writes a non-finite value
        return x if x is None or math.isfinite(x) else None

    def side(s: Side) -> dict:
        return {"overrides": s.overrides, "launcher": s.launcher, "nproc": s.nproc, "precision": s.precision}

    return {"passed": comparison.passed, "tolerance": comparison.tolerance,
            "max_loss_rel_diff": finite(comparison.max_loss_diff),
            "max_grad_norm_rel_diff": finite(comparison.max_grad_norm_diff), "a": side(a), "b": side(b),
            "notes": notes, "steps": [{k: finite(v) for k, v in vars(r).items()} for r in comparison.rows]}


def plot(comparison: Comparison, path: str) -> bool:
    """parity.png: loss and gradient norm of both sides, and both relative differences (log scale) with the
    tolerance. False when matplotlib is missing."""
    if Figure is None:
        return False
    rows = comparison.rows
    steps = [r.step for r in rows]
    fig = Figure(figsize=(13, 4), layout="constrained")
    loss, norm, diff = fig.subplots(1, 3)
    for ax, key, title in ((loss, "loss", "training loss"), (norm, "grad_norm", "gradient norm")):
        for side, style in (("a", "-"), ("b", "--")):
            ax.plot(steps, [_nan(getattr(r, f"{key}_{side}")) for r in rows], style, marker="o", label=side.upper())
        ax.set(title=title, xlabel="step")
        ax.legend()
    floor = 1e-12  # a difference of exactly 0 has no place on a log scale
    for key, label in (("loss_diff", "loss"), ("grad_norm_diff", "gradient norm")):
        diff.plot(steps, [max(_nan(getattr(r, key)), floor) for r in rows], marker="o", label=label)
    diff.axhline(comparison.tolerance, color="red", linestyle=":", label=f"tolerance {comparison.tolerance:g}")
    diff.set(title="relative difference |B - A| / |A|", xlabel="step", yscale="log")
    diff.legend(loc="lower right")
    for ax in (loss, norm, diff):
        ax.xaxis.get_major_locator().set_params(integer=True)  # steps: no 1.5
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    write_atomic(path, lambda fh: fh.write(buffer.getvalue()))
    return True


def _nan(x: Optional[float]) -> float:
    return math.nan if x is None else x


def write_all(out_dir: str, comparison: Comparison, a: Side, b: Side, notes: List[str]) -> List[str]:
    """parity.png, parity.json and parity.md into `out_dir`; the names written."""
    figure = "parity.png" if plot(comparison, os.path.join(out_dir, "parity.png")) else None
    if figure is None:
        notes = notes + ["no figure: matplotlib is not installed (pip install matplotlib)"]
    data = json.dumps(as_json(comparison, a, b, notes), indent=1).encode()
    write_atomic(os.path.join(out_dir, "parity.json"), lambda fh: fh.write(data))
    text = markdown(comparison, a, b, notes, figure).encode()
    write_atomic(os.path.join(out_dir, "parity.md"), lambda fh: fh.write(text))
    return [name for name in (figure, "parity.json", "parity.md") if name]

