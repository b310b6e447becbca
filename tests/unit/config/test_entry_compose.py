"""The entry point composes the config once per process (trainer/config/compose.py: compose_job, then run_job runs
the training as Hydra runs a job): the run directory and its .hydra/ record are what @hydra.main writes, and a bad
command line still ends with one message and exit code 2 before anything heavy is imported."""
from __future__ import annotations

import os
import subprocess
import sys

import yaml

from trainer.config.compose import REPO

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "data.embedded_documents=40", "data.seq_len=32", "train.max_steps=1",
        "train.global_batch_size=4", "train.micro_batch_size=4", "eval.at_end=false", "checkpoint.at_end=false",
        "export.hf_at_end=false", "logging.progress=false"]

# Counts Hydra's compositions in the entry process, then runs trainer/main.py as `python trainer/main.py` does.
COUNTING = """
import runpy, sys
from hydra._internal.hydra import Hydra
calls = []
compose_config = Hydra.compose_config
def counted(self, *a, **k):
    calls.append(1)
    return compose_config(self, *a, **k)
Hydra.compose_config = counted
sys.argv = [sys.argv[1]] + sys.argv[2:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("COMPOSITIONS", len(calls), flush=True)
"""


def _entry(args, run_dir=None):
    extra = [f"hydra.run.dir={run_dir}"] if run_dir else []
    return subprocess.run([sys.executable, "-c", COUNTING, str(REPO / "trainer" / "main.py"), *args, *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_run_composes_once_and_records_what_hydra_main_records(tmp_path):
    out = _entry(TINY + ["train.seed=3"], tmp_path / "run")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "COMPOSITIONS 1" in out.stdout, out.stdout[-2000:]
    record = tmp_path / "run" / ".hydra"
    assert yaml.safe_load((record / "overrides.yaml").read_text())[-1] == "train.seed=3"
    hydra_cfg = yaml.safe_load((record / "hydra.yaml").read_text())["hydra"]
    assert hydra_cfg["mode"] == "RUN" and hydra_cfg["job"]["name"] == "main"
    assert hydra_cfg["runtime"]["output_dir"] == str(tmp_path / "run")
    assert yaml.safe_load((record / "config.yaml").read_text())["train"]["seed"] == 3
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_a_bad_command_line_ends_at_the_one_compose_with_exit_code_2(tmp_path):
    out = _entry(TINY + ["train.max_stepz=3"], tmp_path / "bad")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: the command line does not compose" in out.stderr and "max_stepz" in out.stderr
    assert "Traceback" not in out.stderr and "COMPOSITIONS 1" in out.stdout
    assert not (tmp_path / "bad").exists()  # nothing was created


def test_hydra_flags_go_to_hydra_main_with_the_resolvers_registered():
    out = _entry(["--cfg", "hydra", "--resolve", "train.seed=5"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "run:" in out.stdout and "outputs/" in out.stdout  # hydra.run.dir with ${run_name:} resolved
