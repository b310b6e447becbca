"""Smoke test of benchmarks/bench_checkpoint.py: a tiny model, one repeat; it writes its figures (no speed target,
only that an async save does not block the step longer than a sync one, with a wide margin)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_checkpoint_quick(tmp_path):
    out = tmp_path / "c.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_checkpoint.py"), "--quick", "--dir", str(tmp_path),
         "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    r = json.loads(out.read_text())
    assert r["save_mb_s"] > 0
    assert r["load_mb_s"] > 0
    assert r["disk"]["write_mb_s"] > 0
    assert r["model"]["checkpoint_bytes"] > r["model"]["tensor_bytes"] > 0  # weights + AdamW moments + metadata
    assert r["warm_up"]["load_restores_weights"]
    assert r["warm_up"]["async_holds_state_at_save"]
    b = r["blocking"]
    assert 0 <= b["async_blocking_s"] <= b["sync_blocking_s"] * 1.5 + 0.05, b
    assert "blocking async / sync" in proc.stdout
    assert 0 < r["checksum_s"] < r["save_s"], r  # the checksums are part of the save
    assert "SHA-256 of the saved files" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]  # the work folder was removed
