"""The benchmark scripts (benchmarks/) in their cheapest modes: a debug-size model, a few steps, N <= 2. Timings on
a shared CPU machine mean little, so figures are checked for existence and sanity; collective volumes, which do not
depend on the machine, are checked against the ZeRO paper's formulas."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.warm import base_env, warm_env

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _run(args, timeout: float, expect: int = 0):
    env = dict(base_env(), PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env = warm_env(env)  # the runs the scripts start (tests/warm.py); their step times do not include start-up
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == expect, \
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    return proc


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_throughput_against_bare_loop_and_hf_trainer(tmp_path):
    out = tmp_path / "t.json"
    proc = _run([BENCH / "bench_throughput.py", "--quick", "--out", out], timeout=300)
    result = json.loads(out.read_text())
    assert set(result["tokens_per_s"]) == {"tessera", "bare", "hf"}
    assert all(_positive(v) for v in result["tokens_per_s"].values())
    assert _positive(result["ratio"]["bare"]) and _positive(result["ratio"]["hf"])
    assert "| Tessera trainer |" in proc.stdout


def test_backends_against_their_bare_loops_and_hf_trainer(tmp_path):
    """bench_backends.py --quick on the DeepSpeed engine loop and the FSDP2 loop (the DDP and single loops are the
    same function with another wrap), each against the bare loop and the HF Trainer: ratios and overheads per
    repeat; HF's fsdp row is listed as not run on CPU (accelerate has no FSDP there); a bad row name is one
    message, exit 2."""
    import torch

    out = tmp_path / "b.json"
    proc = _run([BENCH / "bench_backends.py", "--quick", "--rows", "zero2,fsdp", "--against", "bare,hf", "--out", out,
                 "--peak-tflops", "0.5"], timeout=1200)
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    # MFU of every side: all positions per second x FLOPs per token over the given peak of the row's 2 ranks
    per_token = result["config"]["flops_per_token"]
    # 6N + 12·L·d·T: N = 107,840 parameters less the 264 x 64 input embedding, 2 layers, hidden 64, 32 tokens
    assert per_token == 6 * (107_840 - 264 * 64) + 12 * 2 * 64 * 32
    for row in rows.values():
        for side, mfu in row["mfu"].items():
            assert mfu["median"] == pytest.approx(row["tokens_per_s"][side]["median"] * per_token / (0.5e12 * 2))
    assert list(rows) == ["zero2", "fsdp"] and rows["fsdp"]["nproc"] == 2
    for row in rows.values():
        assert all(_positive(row["tokens_per_s"][side]["median"]) for side in ("tessera", "bare"))
        t, b = row["ms_per_step"]["tessera"]["runs"][0], row["ms_per_step"]["bare"]["runs"][0]
        assert row["ratio"]["median"] == pytest.approx(b / t) and row["overhead_ms"]["median"] == pytest.approx(t - b)
    hf_rows = ["zero2", "fsdp"] if torch.cuda.is_available() else ["zero2"]
    for name in hf_rows:
        row = rows[name]
        assert all(_positive(row["ratio_hf"][k]) for k in ("median", "low", "high"))
        t, h = row["ms_per_step"]["tessera"]["runs"][0], row["ms_per_step"]["hf"]["runs"][0]
        assert row["ratio_hf"]["median"] == pytest.approx(h / t)
    if not torch.cuda.is_available():
        assert "ratio_hf" not in rows["fsdp"] and "FSDP" in rows["fsdp"]["not_run"]["hf"]
    assert "| zero2 | 2 |" in proc.stdout and "Tessera / HF" in proc.stdout and "MFU Tessera / bare / hf" in proc.stdout
    plan = _run([BENCH / "bench_backends.py", "--gpu", "1b", "--dry-run", "--nproc", "2"], timeout=120)
    cmds = [ln for ln in plan.stdout.splitlines() if "trainer/main.py" in ln]
    assert len(cmds) == 5 and all("precision=bf16" in c and "model.hidden_size=2048" in c for c in cmds), cmds
    assert "train.global_batch_size=16" in cmds[0] and "GFLOP per token" not in plan.stdout  # no GPU: no peak
    bad = _run([BENCH / "bench_backends.py", "--quick", "--rows", "zero9"], timeout=120, expect=2)
    assert "--rows takes a comma list" in bad.stderr
    bad = _run([BENCH / "bench_backends.py", "--quick", "--against", "trl"], timeout=120, expect=2)
    assert "--against takes a comma list" in bad.stderr


def test_matrix_reports_every_requested_row(tmp_path):
    out = tmp_path / "m.json"
    proc = _run([BENCH / "bench_matrix.py", "--quick", "--strategies", "single,ddp,fsdp,pp", "--world-sizes", "2",
                 "--out", out], timeout=600)
    rows = {(r["strategy"], r["world_size"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("single", 2), ("ddp", 2), ("fsdp", 2), ("pp", 2)}
    assert "not_run" in rows["single", 2]  # one process only: listed with the reason, not run
    for key in (("ddp", 2), ("fsdp", 2), ("pp", 2)):
        row = rows[key]
        assert "error" not in row, row.get("error")
        assert _positive(row["tokens_per_s"]) and _positive(row["launch_to_first_step_s"])
        assert _positive(row["memory"]["model_states"])
        assert _positive(row["checkpoint"]["mib"])
    psi = rows["ddp", 2]["num_params"]
    ddp = rows["ddp", 2]["collectives"]
    # DDP at one micro-batch per step: one all-reduce of every fp32 gradient, 2Ψ in the paper's volume.
    assert ddp["steady"] is True
    assert ddp["volume_bytes"] == pytest.approx(2 * psi * 4, rel=0.02), ddp
    assert ddp["volume_psi"] == pytest.approx(2.0, rel=0.02) and ddp["theory_psi"] == 2.0
    fsdp = rows["fsdp", 2]["collectives"]  # all-gather in forward and backward, reduce-scatter of the gradients
    assert fsdp["volume_psi"] == pytest.approx(3.0, rel=0.05), fsdp
    pipe = rows["pp", 2]["pipeline"]
    assert pipe["theory"] == pytest.approx(1 / 3)  # (p-1)/(m+p-1), p = m = 2
    assert all(0 <= idle < 1 for idle in pipe["idle_per_rank"]) and 0 < pipe["idle"] < 1
    assert "| ddp | 2 |" in proc.stdout


def test_matrix_rejects_an_unknown_strategy():
    proc = _run([BENCH / "bench_matrix.py", "--quick", "--strategies", "ddp,zero9"], timeout=60, expect=2)
    assert "unknown strategies ['zero9']" in proc.stderr and "Traceback" not in proc.stderr


def test_gpu_script_dry_run_prints_the_plan():
    proc = _run([BENCH / "bench_gpu.py", "--dry-run", "--nproc", "8"], timeout=180)
    out = proc.stdout
    assert "0.5b: 0.50B" in out and "1b: 0.97B" in out
    cmds = [ln for ln in out.splitlines() if "trainer/main.py" in ln]
    assert len(cmds) == 6  # 2 sizes x (fsdp, fsdp + compile, zero3)
    assert all("precision=bf16" in c and ("--nproc_per_node=8" in c or "--num_gpus 8" in c) for c in cmds)
    assert sum("train.compile=true" in c for c in cmds) == 2
    assert sum("strategy=zero3" in c and "deepspeed" in c for c in cmds) == 2


def test_soak_keeps_memory_files_and_disk_flat(tmp_path):
    """200 steps with a checkpoint every 20 and keep_last 2 (the README's figures are from 1,000 steps): each
    rank's resident memory grows under 5% after warm-up, no file descriptor leaks, at most keep_last + 1
    checkpoint folders ever exist."""
    out = tmp_path / "soak.json"
    proc = _run([BENCH / "bench_soak.py", "--quick", "--out", out], timeout=600)
    result = json.loads(out.read_text())
    assert set(result["ranks"]) == {"0", "1"} and all(r["samples"] >= 10 for r in result["ranks"].values()), result
    for rank in result["ranks"].values():
        assert rank["rss_growth_pct"] < 5.0 and rank["fds_late"] <= rank["fds_warm"], result
    assert 1 <= result["checkpoints_max"] <= 3 and result["flat"] is True, result
    assert "| rank | RSS MiB after warm-up |" in proc.stdout


def test_comm_benchmark_reports_bytes_and_losses_per_mode(tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    proc = _run([BENCH / "bench_comm.py", "--quick", "--modes", "sync,bf16,local_sgd_h8", "--out", out], timeout=600)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"sync", "bf16", "local_sgd_h8"} and not any("error" in r for r in rows.values())
    # bytes do not depend on the machine: bf16 halves the gradient, local SGD sends the weights every 8th step
    assert rows["bf16"]["comm_bytes_per_step"] == rows["sync"]["comm_bytes_per_step"] / 2
    assert rows["local_sgd_h8"]["comm_bytes_per_step"] == rows["sync"]["comm_bytes_per_step"] / 8
    for r in rows.values():
        assert _positive(r["val_loss"]) and _positive(r["tokens_per_s"]) and len(r["curve"]) == 64
    assert "| local_sgd_h8 |" in proc.stdout and "8.0x" in proc.stdout
    assert not png.exists()


def test_packing_benchmark_reports_the_speedup_over_padding(tmp_path, generated_data):
    out = tmp_path / "p.json"
    proc = _run([BENCH / "bench_packing.py", "--quick", "--data", generated_data.alpaca, "--out", out], timeout=300)
    rows = {r["packing"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"eos", "documents"}
    # the generated examples (~200 tokens) go two to a 512-token sequence: about twice the loss positions per step
    assert rows["documents"]["target_tokens_per_step"] > 1.6 * rows["eos"]["target_tokens_per_step"]
    assert rows["documents"]["loss_positions"] > 1.6 * rows["eos"]["loss_positions"]
    assert all(_positive(r["target_tokens_per_s"]) and _positive(r["speedup"]) for r in rows.values())
    assert "| documents |" in proc.stdout


def test_data_benchmark_memory_stays_flat_and_tokenizer_throughput_is_measured(tmp_path):
    """bench_data.py --quick: training's peak memory at 8x the corpus within 15% of 1x, from text, from a store and
    streamed (the 8x corpus holds 8x the tokens); tokenization figures for 1 and 2 workers and datasets.map beside
    them; the first step from the store that 2 workers wrote."""
    out = tmp_path / "d.json"
    proc = _run([BENCH / "bench_data.py", "--quick", "--out", out], timeout=900)
    result = json.loads(out.read_text())
    assert [r["source"] for r in result["memory"]] == ["data=text", "data=tokens", "data=text data.streaming=true"]
    for row in result["memory"]:
        assert row["ratio"] < 1.15, row
    assert [r["workers"] for r in result["tokenize"]] == [1, 2]
    assert all(_positive(r["tessera_tokens_per_s"]) and _positive(r["datasets_map_tokens_per_s"])
               for r in result["tokenize"])
    assert result["tokenize"][0]["tokens"] == result["tokenize"][1]["tokens"] > 1_000_000
    first = result["first_step"]
    assert _positive(first["seconds"]) and first["tokens"] == result["tokenize"][1]["tokens"]
    assert first["corpus_bytes"] == result["corpus_bytes"] and "| data=tokens |" in proc.stdout


def test_long_context_script_prints_both_commands_and_runs_ulysses_on_cpu(tmp_path):
    """bench_long_context.py: the dry run lists one command per cp_impl at 32k tokens over the context ranks; --quick
    runs Ulysses on 2 CPU ranks end to end (losses, activations per rank from memory.json) and lists ring as
    skipped (no CUDA kernels here)."""
    proc = _run([BENCH / "bench_long_context.py", "--dry-run", "--nproc", "4"], timeout=120)
    cmds = [ln for ln in proc.stdout.splitlines() if "trainer/main.py" in ln]
    assert len(cmds) == 2 and all("strategy.cp=4" in c and "data.seq_len=32768" in c for c in cmds), cmds
    assert ["strategy.cp_impl=ulysses" in cmds[0], "strategy.cp_impl=ring" in cmds[1]] == [True, True]
    out = tmp_path / "cp.json"
    proc = _run([BENCH / "bench_long_context.py", "--quick", "--out", out], timeout=300)
    result = json.loads(out.read_text())["impls"]
    assert result["ring"]["skipped"] == "ring attention needs CUDA kernels", result
    ulysses = result["ulysses"]
    assert len(ulysses["losses"]) == 3 and all(map(_positive, ulysses["losses"])), ulysses
    assert ulysses["activations_per_rank"] > 0 and ulysses["tokens_per_s"] > 0, ulysses
    assert "| ulysses |" in proc.stdout and "| ring | ring attention needs CUDA kernels |" in proc.stdout
