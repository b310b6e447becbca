"""Smoke test of benchmarks/bench_pipeline.py: --quick (gpipe and 1f1b at pp=2, m=4, a small model, one launch of
2 gloo ranks, about 20-40 s) writes sensible figures; no speed target. Plus the replay simulator on a hand-made
GPipe order."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_pipeline.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_pipeline", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_simulate_gpipe_order_gives_the_gpipe_bubble():
    bp = _module()
    p, m = 3, 4
    orders = [[("F", r, mb, 1.0) for mb in range(m)] + [("B", r, mb, 2.0) for mb in range(m)] for r in range(p)]
    makespan, busy = bp.simulate(orders, p)
    assert busy == [3.0 * m] * p
    assert makespan == 3.0 * (m + p - 1)
    assert bp.sim_idle(orders, p) == pytest.approx(bp.theory("gpipe", p, 1, m))
    # an order that cannot run (a backward before its forward exists anywhere) is reported, not looped on
    assert bp.simulate([[("B", 0, 0, 1.0)]], 1) is None


def test_bench_pipeline_quick(tmp_path):
    out = tmp_path / "p.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    r = json.loads(out.read_text())
    rows = r["rows"]
    assert [(x["schedule"], x["pp"], x["micro_batches"]) for x in rows] == [("gpipe", 2, 4), ("1f1b", 2, 4)]
    for row in rows:
        assert "skipped" not in row, row
        assert row["theory"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
        # torch's own action order, replayed with unit times and free communication, has exactly that bubble
        assert row["order_idle"] == pytest.approx(row["theory"])
        assert len(row["idle_per_rank"]) == 2
        for idle in row["idle_per_rank"] + [row["idle_mean"], row["sim_idle"]]:
            assert 0 <= idle < 1, row
        assert 0 < row["pipeline_s"] <= row["step_s"], row
        for rank in row["ranks"]:
            assert rank["actions_per_step"] == {"B": 4, "F": 4}, rank  # m forwards and m full backwards
            assert rank["busy_s"] > 0
        assert {"F", "B"} <= set(row["op_ms_mean"]) and all(v > 0 for v in row["op_ms_mean"].values())
    assert "| schedule | p | v | m | theory |" in proc.stdout
    assert "wrote" in proc.stdout
