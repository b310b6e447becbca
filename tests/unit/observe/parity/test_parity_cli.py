"""`python -m trainer.parity` (trainer/observe/parity/command.py): the command line, the two sides it makes, the
files and exit codes of a check (the runs replaced by canned metrics), and one-line exits 2 on bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import LlamaConfig

from tests.conftest import REPO
from trainer.observe.parity import command
from trainer.observe.parity.command import EXIT_DIFFERS, main, parser
from trainer.observe.parity.runs import error_tail
from trainer.observe.parity.shrink import preset_overrides, shrink_hf_config
from trainer.observe.parity.sides import forced


def canned(losses_by_label):
    """A run_side that returns `losses_by_label[side.label]` as metrics records."""
    def run_side(side, run_dir, timeout):
        os.makedirs(run_dir)
        return [{"step": i + 1, "loss": x, "grad_norm": 1.0} for i, x in enumerate(losses_by_label[side.label])]
    return run_side


def test_the_against_side_starts_from_side_a_and_options_go_to_either_side():
    args = parser().parse_args(["strategy=single", "precision=fp32", "--against", "strategy=ddp", "--steps", "4",
                                "--against-nproc", "2", "--tolerance", "1e-4", "--out", "x"])
    assert args.overrides == ["strategy=single", "precision=fp32"] and args.against == ["strategy=ddp"]
    assert (args.steps, args.against_nproc, args.nproc, args.tolerance, args.out) == (4, 2, None, 1e-4, "x")
    assert parser().parse_args(["--against", "a=1"]).steps == 10  # the default


def test_forced_overrides_make_a_cheap_comparable_run():
    f = forced(7)
    assert {"train.max_steps=7", "train.log_every=1", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false",
            "checkpoint.at_end=false", "checkpoint.every=0"} <= set(f)


def test_shrink_keeps_heads_dividing():
    assert "model.num_kv_heads=2" in preset_overrides("llama") and "model.num_kv_heads=null" in preset_overrides("gpt2")
    config = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, head_dim=64)
    shrink_hf_config(config)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.head_dim) == (2, 64, 4, 2, 128, 16)


@pytest.mark.parametrize("b_losses, code, word", [([5.0, 4.0], 0, "PASS"), ([5.0, 4.01], EXIT_DIFFERS, "FAIL")])
def test_a_check_prints_the_table_and_writes_its_files(tmp_path, monkeypatch, capsys, b_losses, code, word):
    monkeypatch.setattr(command, "run_side", canned({"A": [5.0, 4.0], "B": b_losses}))
    assert main(["strategy=single", "--against", "strategy=ddp", "--against-nproc", "2", "--steps", "2",
                 "--out", str(tmp_path)]) == code
    out = capsys.readouterr().out
    assert "step       loss A       loss B  rel diff" in out and f"parity {word}" in out
    assert "tolerance 1e-05, fp32 vs fp32" in out
    data = json.loads((tmp_path / "parity.json").read_text())
    assert data["passed"] is (code == 0) and data["b"]["launcher"] == "torchrun" and data["b"]["nproc"] == 2
    assert [s["step"] for s in data["steps"]] == [1, 2]
    assert f"parity {word}" in (tmp_path / "parity.md").read_text()
    assert (tmp_path / "parity.png").stat().st_size > 0
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary file left


def test_a_bf16_side_gets_the_looser_tolerance(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(command, "run_side", canned({"A": [5.0], "B": [5.01]}))
    assert main(["strategy=single", "--against", "precision=bf16", "--steps", "1", "--out", str(tmp_path)]) == 0
    assert "tolerance 0.03, fp32 vs bf16" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["strategy=single", "--against", "train.seed=7"], "differ in train.seed"),
    (["strategy=single", "--against", "train.global_batch_size=32"], "differ in train.global_batch_size"),
    (["strategy=single", "--against", "data.seq_len=16"], "differ in data"),
    (["strategy=single", "--nproc", "2", "--against", "strategy=ddp"], "the python launcher starts one process"),
    (["strategy=ddp", "--nproc", "2", "--against", "--against-nproc", "0"], "at least 1"),
    (["strategy=single", "--against", "strategy=nope"], "side B (strategy=single strategy=nope)"),
    (["strategy=single", "--tolerance", "0", "--against", "strategy=ddp"], "--tolerance must be"),
])
def test_bad_input_is_one_message_and_exit_2(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(command, "run_side", canned({}))  # never reached
    assert main(argv + ["--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


def test_an_earlier_parity_folder_is_not_reused(tmp_path, monkeypatch, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("{}\n")
    monkeypatch.setattr(command, "run_side", canned({}))
    assert main(["strategy=single", "--against", "strategy=ddp", "--out", str(tmp_path)]) == 2
    assert "holds an earlier parity run" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--steps", "0", "--against", "strategy=ddp"], "--steps must be at least 1, not 0"),
    (["strategy=single", "--against", "strategy=single"], "the two sides are the same run"),
    (["strategy=single", "train.bogus=1", "--against", "strategy=ddp"], "side A (strategy=single train.bogus=1): "
                                                                         "the command line does not compose"),
    (["strategy=single"], "the following arguments are required: --against"),
])
def test_the_command_exits_2_with_one_line_and_no_traceback(tmp_path, args, message):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "trainer.parity", *args, "--out", str(tmp_path / "p")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "p").exists()  # nothing was written


def test_a_failed_sides_tail_starts_at_its_error_line():
    out = "step 1\nwarning: x\nerror: 1 configuration problem(s):\n  - train.a=1 must be > 2\n\ntrailing\n"
    assert error_tail(out) == ["error: 1 configuration problem(s):", "  - train.a=1 must be > 2", "trailing"]
    assert error_tail("\n".join(f"line {i}" for i in range(30)), lines=2) == ["line 28", "line 29"]  # a traceback
