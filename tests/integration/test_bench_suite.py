"""Smoke tests of the benchmark suite (benchmarks/run_suite.py) and the GPU script's plan (benchmarks/bench_gpu.py).

The default test runs a slice of the suite's --quick mode (one ddp run at N = 2 through the collective probe, and
the HF Trainer peer for the same row: about a minute on 2 CPU cores); the whole --quick suite is marked slow.
Figures are not asserted against targets (timings on a shared CPU machine mean little), only that they exist, are
finite and positive, and that DDP's bytes per step are the theory's 2Ψ exactly (one all-reduce of every gradient).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "benchmarks" / "run_suite.py"
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_peers as BP  # noqa: E402


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _run(args, timeout: float):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    return proc


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_suite_quick_slice_writes_report_and_plots(tmp_path):
    plots = _has_matplotlib()  # the `bench` extra; without it the suite runs with --no-plots
    out = tmp_path / "report"
    _run([str(SUITE), "--quick", "--sections", "matrix,peers", "--strategies", "ddp", "--world-sizes", "2",
          "--peer-rows", "ddp", "--out-dir", str(out), *([] if plots else ["--no-plots"])], timeout=420)
    report = (out / "report.md").read_text()
    for heading in ("## 2. Strategies", "## 3. Bytes moved by collectives", "## 5. Time from launch",
                    "## 8. Peer comparison"):
        assert heading in report
    res = json.loads((out / "results.json").read_text())
    (row,) = res["sections"]["matrix"]["rows"]
    assert "error" not in row, row.get("error")
    assert row["strategy"] == "ddp" and row["world_size"] == 2
    assert _finite_positive(row["tokens_per_s"])
    assert all(_finite_positive(x) for x in row["memory"]["model_states_bytes"])
    assert all(_finite_positive(x) for x in row["memory"]["peak_rss_bytes"])
    assert _finite_positive(row["timeline"]["launch_to_first_step_s"])
    coll = row["collectives"]
    assert abs(coll["volume_psi"] - 2.0) < 0.01, coll  # DDP: one all-reduce of Ψ gradient elements per step
    assert coll["steady"] is True
    (peer,) = res["sections"]["peers"]["rows"]
    assert not peer["errors"], peer["errors"]
    assert _finite_positive(peer["tessera_tokens_per_s"]) and _finite_positive(peer["hf_tokens_per_s"])
    assert _finite_positive(peer["ratio"])
    lo, hi = peer["ratio_interval"]
    assert lo <= peer["ratio"] <= hi and peer["verdict"] in ("met", "not met", "within noise")
    (hf_run,) = peer["runs"]["hf"]  # one repeat: the row's figure is its median step's tokens/s
    assert len(hf_run["step_times_s"]) == len(hf_run["step_tokens"]) == 10
    assert abs(peer["hf_tokens_per_s"] - BP.median_step_rate([hf_run])) < 1e-9
    assert len(peer["pair_ratios"]) == 1
    # HF runs the AdamW kernel Tessera picks by default (optim.implementation=auto: fused on CPU).
    assert peer["runs"]["hf"][0]["optim"] == "adamw_torch_fused"
    pngs = sorted(p.name for p in out.glob("*.png"))
    if plots:
        assert {"matrix_tokens.png", "collectives.png", "peers.png"} <= set(pngs), pngs
        assert "](collectives.png)" in report
    else:
        assert pngs == []
    assert not (out / "runs").exists()  # run directories are removed without --keep-runs


def test_suite_without_matplotlib_stops_with_one_message(tmp_path):
    code = ("import sys, runpy; sys.modules['matplotlib'] = None; "
            f"sys.argv = [{str(SUITE)!r}, '--quick', '--out-dir', {str(tmp_path / 'r')!r}]; "
            f"runpy.run_path({str(SUITE)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "matplotlib" in proc.stderr and "pip install -e '.[bench]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


def test_bench_gpu_dry_run_prints_the_plan():
    proc = _run([str(REPO / "benchmarks" / "bench_gpu.py"), "--dry-run", "--nproc", "8"], timeout=180)
    out = proc.stdout
    assert "0.5b: 0.50" in out and "1b: 0.97" in out  # billions of parameters
    cmds = [ln for ln in out.splitlines() if "trainer/main.py" in ln]
    assert len(cmds) == 6  # 2 sizes x (fsdp, fsdp + compile, zero3)
    assert all("precision=bf16" in c and ("--nproc_per_node 8" in c or "--num_gpus 8" in c) for c in cmds)
    assert sum("train.compile=true" in c for c in cmds) == 2
    assert sum("strategy=zero3" in c and "deepspeed" in c for c in cmds) == 2
    assert "6N + 12·L·d·T" in out


@pytest.mark.slow
def test_suite_quick_end_to_end(tmp_path):
    """The whole --quick suite: every default section (a few minutes on 2 CPU cores)."""
    if not _has_matplotlib():
        pytest.skip("matplotlib is not installed (pip install -e '.[bench]')")
    out = tmp_path / "report"
    _run([str(SUITE), "--quick", "--out-dir", str(out)], timeout=1800)
    res = json.loads((out / "results.json").read_text())
    assert set(res["sections"]) == {"throughput", "matrix", "checkpoint", "pipeline", "peers"}
    t = res["sections"]["throughput"]["result"]
    assert _finite_positive(t["ratio"])
    c = res["sections"]["checkpoint"]["result"]
    assert _finite_positive(c["save_mb_s"]) and _finite_positive(c["load_mb_s"])
    rows = res["sections"]["matrix"]["rows"]
    assert {(r["strategy"], r["world_size"]) for r in rows} == {
        ("single", 1), ("ddp", 2), ("zero2", 2), ("zero3", 2), ("fsdp", 2)}
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    fsdp = next(r for r in rows if r["strategy"] == "fsdp" and r["world_size"] == 2)
    assert fsdp["accum"] == 1
    assert abs(fsdp["collectives"]["volume_psi"] - 3.0) < 0.01  # FSDP2: all-gather x 2 + reduce-scatter
    peers = res["sections"]["peers"]["rows"]
    assert [p["row"] for p in peers] == ["single", "ddp", "zero2", "zero3"]
    assert not [p["errors"] for p in peers if p["errors"]]
    for p in peers:
        if p["row"].startswith("zero"):  # the HF Trainer really ran DeepSpeed: it moved the same bytes
            assert p["runs"]["hf"][0]["stack"]["wrapped_model"] == "DeepSpeedEngine"
            assert p["collective_bytes_per_step"]["hf"] == p["collective_bytes_per_step"]["tessera"] > 0
    assert len(list(out.glob("*.png"))) >= 6
