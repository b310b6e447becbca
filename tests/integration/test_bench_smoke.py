"""Smoke test of benchmarks/bench_throughput.py: it runs both sides and writes its figures (no speed assertion)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_throughput_quick(tmp_path):
    out = tmp_path / "b.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_throughput.py"), "--quick", "--threads", "1",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["bare_tokens_per_s"] > 0
    assert result["trainer_tokens_per_s"] > 0
    assert "ratio" in result and math.isfinite(result["ratio"]) and result["ratio"] > 0
    assert "ratio trainer/bare" in proc.stdout
