"""bench_peers' statistics: the median step's tokens/s, its bootstrap interval and the verdict on the target."""
from __future__ import annotations

import random
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_peers as BP  # noqa: E402


def _runs(step_s: float, spread: float, repeats: int = 4, steps: int = 10, tokens: int = 256, seed: int = 0):
    rng = random.Random(seed)
    return [{"step_times_s": [step_s * (1 + rng.uniform(-spread, spread)) for _ in range(steps)],
             "step_tokens": [tokens] * steps} for _ in range(repeats)]


def test_median_step_rate_ignores_a_stalled_step():
    run = {"step_times_s": [1.0, 1.0, 1.0, 4.0, 1.0], "step_tokens": [256] * 5}
    assert BP.median_step_rate([run]) == pytest.approx(256.0)
    # The per-run figure (tokens over summed time) is what a stall drags down: 1280 / 8 s.
    assert sum(run["step_tokens"]) / sum(run["step_times_s"]) == pytest.approx(160.0)


@pytest.mark.parametrize("tessera_step_s,expected", [(0.8, "met"), (1.25, "not met"), (1.0, "within noise")])
def test_interval_and_verdict(tessera_step_s, expected):
    tessera, hf = _runs(tessera_step_s, 0.05, seed=1), _runs(1.0, 0.05, seed=2)
    ratio = BP.median_step_rate(tessera) / BP.median_step_rate(hf)
    lo, hi = BP.bootstrap_ratio(tessera, hf)
    assert lo <= ratio <= hi
    assert ratio == pytest.approx(1.0 / tessera_step_s, rel=0.05)
    assert BP.verdict([lo, hi]) == expected


def test_drift_between_runs_widens_the_interval():
    steady = _runs(1.0, 0.02, seed=3)
    drifting = [{"step_times_s": [t * scale for t in r["step_times_s"]], "step_tokens": r["step_tokens"]}
                for r, scale in zip(_runs(1.0, 0.02, seed=3), (0.85, 1.15, 0.9, 1.1))]
    narrow = BP.bootstrap_ratio(steady, _runs(1.0, 0.02, seed=4))
    wide = BP.bootstrap_ratio(drifting, _runs(1.0, 0.02, seed=4))
    assert wide[1] - wide[0] > 3 * (narrow[1] - narrow[0])
