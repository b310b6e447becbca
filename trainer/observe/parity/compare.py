"""The comparison of two runs' logged steps: per-step relative differences of the loss and the gradient norm, their
largest values, and pass/fail against a tolerance that depends on the two sides' precisions."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

# fp32: every layout reorders the same fp32 sums (reductions over ranks, shards, micro-batches), ~1e-7 relative per
# step; tests/integration/conftest.py holds its own runs to 1e-6. 1e-5 leaves room for longer runs and bigger models
# and still catches a wrong scale, a missed token or a stale gradient (>= 1e-4).
# bf16 keeps 8 mantissa bits (~4e-3 relative per rounding) in the forward and backward passes, compounding over the
# steps; 3e-2 is a few times what 10 steps show (tests/integration/test_deepspeed.py). fp16 has more mantissa bits
# but loss scaling and overflow-skipped steps: the same bound.
TOLERANCES = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 3e-2}


def tolerance_for(precision_a: str, precision_b: str) -> float:
    """The relative tolerance for a pair of precisions: the looser of the two sides' (an unknown name: fp32's)."""
    return max(TOLERANCES.get(precision_a, TOLERANCES["fp32"]), TOLERANCES.get(precision_b, TOLERANCES["fp32"]))


def rel_diff(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """|b - a| / |a| (side A is the reference); None when either value was not logged, inf when either is not
    finite (a non-finite value never passes)."""
    if a is None or b is None:
        return None
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(b - a) / max(abs(a), 1e-12)


@dataclass(frozen=True)
class Row:
    step: int
    loss_a: Optional[float]
    loss_b: Optional[float]
    loss_diff: Optional[float]
    grad_norm_a: Optional[float]
    grad_norm_b: Optional[float]
    grad_norm_diff: Optional[float]


@dataclass(frozen=True)
class Comparison:
    rows: List[Row]
    tolerance: float
    max_loss_diff: float
    max_grad_norm_diff: Optional[float]  # None: no step has a gradient norm on both sides

    @property
    def passed(self) -> bool:
        return self.max_loss_diff <= self.tolerance and (self.max_grad_norm_diff is None
                                                         or self.max_grad_norm_diff <= self.tolerance)


def _by_step(records) -> Dict[int, dict]:
    return {int(r["step"]): r for r in records if "step" in r and "loss" in r}


def _value(record: dict, key: str) -> Optional[float]:
    """The record's number under `key`: None when not logged, nan when logged as null (a non-finite value)."""
    if key not in record:
        return None
    value = record[key]
    return float(value) if isinstance(value, (int, float)) else math.nan


def compare(records_a, records_b, steps: int, tolerance: float) -> Comparison:
    """Steps 1..`steps` of two metrics.jsonl record lists. A loss one side did not log (a missing step) or logged as
    null (non-finite) is a difference of inf: it never passes. A gradient norm that one side does not log is left
    out (n/a)."""
    a, b = _by_step(records_a), _by_step(records_b)
    rows = []
    for step in range(1, steps + 1):
        ra, rb = a.get(step, {}), b.get(step, {})
        loss_a, loss_b = _value(ra, "loss"), _value(rb, "loss")
        loss_diff = rel_diff(loss_a, loss_b)
        gn_a, gn_b = _value(ra, "grad_norm"), _value(rb, "grad_norm")
        rows.append(Row(step, loss_a, loss_b, math.inf if loss_diff is None else loss_diff, gn_a, gn_b,
                        rel_diff(gn_a, gn_b)))
    grad_diffs = [r.grad_norm_diff for r in rows if r.grad_norm_diff is not None]
    return Comparison(rows, tolerance, max(r.loss_diff for r in rows), max(grad_diffs) if grad_diffs else None)
