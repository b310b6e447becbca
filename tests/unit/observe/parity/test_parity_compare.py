"""The parity check's comparison (trainer/observe/parity/compare.py): relative differences per step, the tolerance
of each pair of precisions, pass/fail."""
from __future__ import annotations

import math

import pytest

from trainer.observe.parity.compare import TOLERANCES, compare, rel_diff, tolerance_for


def recs(losses, norms=None):
    norms = norms or [1.0] * len(losses)
    return [{"step": i + 1, "loss": loss, "grad_norm": norm, "lr": 1e-3} for i, (loss, norm) in
            enumerate(zip(losses, norms))]


def test_rel_diff_is_relative_to_side_a():
    assert rel_diff(2.0, 2.0) == 0.0
    assert rel_diff(2.0, 2.2) == pytest.approx(0.1)
    assert rel_diff(4.0, 3.0) == pytest.approx(0.25)
    assert rel_diff(0.0, 1e-13) == pytest.approx(0.1)  # a zero reference: divided by 1e-12, not by zero
    assert rel_diff(None, 1.0) is None and rel_diff(1.0, None) is None
    assert rel_diff(math.nan, 1.0) == math.inf and rel_diff(1.0, math.inf) == math.inf


@pytest.mark.parametrize("a, b, expected", [
    ("fp32", "fp32", 1e-5), ("bf16", "bf16", 3e-2), ("fp32", "bf16", 3e-2), ("bf16", "fp32", 3e-2),
    ("fp16", "fp32", 3e-2), ("fp16", "bf16", 3e-2), ("something", "fp32", 1e-5)])
def test_tolerance_is_the_looser_sides(a, b, expected):
    assert tolerance_for(a, b) == expected


def test_fp32_tolerance_is_tighter_than_half_precision():
    assert TOLERANCES["fp32"] < TOLERANCES["bf16"] and TOLERANCES["fp32"] <= 1e-5


def test_per_step_differences_and_their_largest():
    c = compare(recs([5.0, 4.0, 3.0], [2.0, 1.0, 1.0]), recs([5.0, 4.0 * (1 + 2e-6), 3.0], [2.0, 1.0, 1.0 + 4e-6]),
                steps=3, tolerance=1e-5)
    assert [r.step for r in c.rows] == [1, 2, 3]
    assert [r.loss_diff for r in c.rows] == pytest.approx([0.0, 2e-6, 0.0])
    assert [r.grad_norm_diff for r in c.rows] == pytest.approx([0.0, 0.0, 4e-6])
    assert c.max_loss_diff == pytest.approx(2e-6) and c.max_grad_norm_diff == pytest.approx(4e-6)
    assert c.passed


def test_a_difference_over_the_tolerance_fails_loss_or_grad_norm():
    assert not compare(recs([5.0]), recs([5.001]), 1, 1e-5).passed  # 2e-4 loss
    assert not compare(recs([5.0], [1.0]), recs([5.0], [1.001]), 1, 1e-5).passed  # 1e-3 grad norm
    assert compare(recs([5.0]), recs([5.001]), 1, 3e-2).passed  # within a bf16 tolerance


def test_a_missing_step_or_non_finite_loss_fails():
    missing = compare(recs([5.0, 4.0]), recs([5.0]), 2, 1e-5)
    assert missing.rows[1].loss_b is None and missing.max_loss_diff == math.inf and not missing.passed
    null = compare(recs([5.0]), [{"step": 1, "loss": None, "grad_norm": None}], 1, 1.0)
    assert null.max_loss_diff == math.inf and not null.passed


def test_a_grad_norm_not_logged_is_left_out():
    c = compare([{"step": 1, "loss": 5.0}], [{"step": 1, "loss": 5.0}], 1, 1e-5)
    assert c.rows[0].grad_norm_diff is None and c.max_grad_norm_diff is None and c.passed


def test_records_without_a_loss_are_not_steps():
    a = recs([5.0]) + [{"step": 1, "val_loss": 9.0}]
    assert compare(a, recs([5.0]), 1, 1e-5).rows[0].loss_a == 5.0
