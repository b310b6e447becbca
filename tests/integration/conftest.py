"""Helpers for integration tests: run the real entry point through a real launcher and read its outputs."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# fp32 parity with one process: the relative error of every logged loss and gradient norm. Every layout reorders
# the same fp32 sums (reductions over ranks, shards, micro-batches), which costs ~1e-7 relative; 1e-6 leaves a
# factor of ~10 and still catches a wrong scale, a missed token or a stale gradient (>= 1e-4).
FP32_TOL = 1e-6

from tests.warm import base_env, warm_env  # noqa: E402
from trainer.launch.choose import launcher_command, run_process_group  # noqa: E402
from trainer.parallel.dims import free_port  # noqa: E402,F401 - tests import it from here

VENV_BIN = Path(sys.executable).parent

# A debug-size model and corpus: every launch costs seconds of start-up, the steps themselves little.
SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.intermediate_size=128", "data.embedded_documents=400", "data.seq_len=32", "scheduler.warmup_steps=1",
         "logging.progress=false"]


def short_documents(path) -> Path:
    """Write 400 JSONL documents of 1 to 40 words (seeded) to `path`: many fit several to a sequence of 64
    tokens under data.packing=documents, some are cut."""
    import random

    rng = random.Random(0)
    words = "the a my thy love night day sword heart light moon star rose house peace fortune grave".split()
    Path(path).write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))})
                                  + "\n" for _ in range(400)))
    return Path(path)


def launch(launcher: str, overrides, run_dir, nproc: int = 1, timeout: float = 300, env=None, warm: bool = True):
    """Start trainer/main.py with `python`, `torchrun`, `torchrun-quiet` or `deepspeed`; the CompletedProcess.
    `warm`: the ranks start from the warm-start server (tests/warm.py; what differs from a cold start is listed
    there); a test of the ranks' process tree, parents or SIGSTOP passes warm=False."""
    full_env = base_env()
    full_env.update(env or {})
    if warm:
        full_env = warm_env(full_env, overrides)
    cmd = launcher_command(launcher, nproc) + list(overrides) + [f"hydra.run.dir={run_dir}"]
    return run_process_group(cmd, env=full_env, timeout=timeout)


def ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"


def memory_reports(root, runs: dict, overrides, workers: int, timeout: float = 300) -> dict:
    """name -> memory.json of each run in `runs` (name -> (launcher, nproc, extra overrides)), `workers` of them
    at a time (the runs are mostly start-up time)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(name):
        launcher, nproc, extra = runs[name]
        ok(launch(launcher, list(overrides) + list(extra), Path(root) / name, nproc=nproc, timeout=timeout))
        return json.loads((Path(root) / name / "memory.json").read_text())

    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(runs, pool.map(run, runs)))


def curve_errors(recs, reference, same_steps: bool = False):
    """(max relative loss error, max relative grad-norm error) of the logged steps `recs` against the same steps
    of `reference` (which may hold more, unless `same_steps`)."""
    ref = {r["step"]: r for r in reference}
    steps = [r["step"] for r in recs]
    assert recs and all(step in ref for step in steps), steps
    if same_steps:
        assert steps == [r["step"] for r in reference], (steps, [r["step"] for r in reference])
    return (max(rel_err(r["loss"], ref[r["step"]]["loss"]) for r in recs),
            max(rel_err(r["grad_norm"], ref[r["step"]]["grad_norm"]) for r in recs))


def check_parity(name, recs, reference, tol=FP32_TOL, steps=10):
    """Steps 1..`steps` of `recs` match the same steps of the reference within `tol` (relative), loss and grad
    norm; prints and returns the errors."""
    assert [r["step"] for r in recs] == list(range(1, steps + 1)), [r["step"] for r in recs]
    loss_err, norm_err = curve_errors(recs, reference)
    print(f"{name}: max relative loss error {loss_err:.2e}, grad-norm error {norm_err:.2e}")
    assert loss_err < tol and norm_err < tol, (loss_err, norm_err)
    return loss_err, norm_err


def read_jsonl(path) -> list:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def metrics(run_dir) -> list:
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def rel_err(a, b) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def pretrained_overrides(source) -> list:
    """A pretrained Llama (tests.conftest.DataSource: the generated tiny Llama, or stories260K) on its text corpus
    for 5 logged steps, evaluated before the first step, with memory.json: the pretrained-model parity runs."""
    return ["model=hf", f"model.name_or_path={source.model}", "data=text", f"data.path={source.text}",
            "data.seq_len=64", "scheduler.warmup_steps=1", "logging.progress=false", "train.max_steps=5",
            "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2", "eval.every=0",
            "eval.at_start=true", "eval.max_sequences=16", "eval.at_end=false", "export.hf_at_end=false",
            "checkpoint.at_end=false", "logging.memory_report=true"]


REMOTE_CONFIG = """from transformers import LlamaConfig


class ToyConfig(LlamaConfig):
    model_type = "toy_llama"
"""
REMOTE_MODELING = """from transformers import LlamaForCausalLM

from .configuration_toy import ToyConfig


class ToyForCausalLM(LlamaForCausalLM):
    config_class = ToyConfig
"""


def remote_code_copy(model_folder, dest) -> Path:
    """`model_folder` as a remote-code model: the same weights under classes of its own (configuration_toy.py,
    modeling_toy.py, Llama subclasses named by config.json's auto_map), which only trust_remote_code loads."""
    dest = Path(dest)
    shutil.copytree(model_folder, dest)
    (dest / "configuration_toy.py").write_text(REMOTE_CONFIG)
    (dest / "modeling_toy.py").write_text(REMOTE_MODELING)
    config = json.loads((dest / "config.json").read_text())
    config.update(model_type="toy_llama", architectures=["ToyForCausalLM"],
                  auto_map={"AutoConfig": "configuration_toy.ToyConfig",
                            "AutoModelForCausalLM": "modeling_toy.ToyForCausalLM"})
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    return dest


@pytest.fixture(scope="session")
def pretrained_reference(generated_data, tmp_path_factory):
    """One process on the generated pretrained model (pretrained_overrides), shared by the ZeRO-3, FSDP and TP
    runs. (Their sharded loading reads the folder the same way whatever wrote it; the real stories260K folder is
    loaded by test_finetune.py's [real] variant.)"""
    run_dir = tmp_path_factory.mktemp("pretrained-single")
    ok(launch("python", pretrained_overrides(generated_data) + ["strategy=single"], run_dir))
    return run_dir


def check_pretrained_loaded(run_dir, source, overrides, name: str) -> float:
    """The run's validation loss before its first step is the one of the folder's weights loaded with
    from_pretrained on one process (relative 1e-6): the strategy really trained the pretrained weights, not a
    fresh initialization. Returns the relative error."""
    from transformers import AutoModelForCausalLM

    first = read_jsonl(Path(run_dir) / "eval.jsonl")[0]
    assert first["step"] == 0, first
    model = AutoModelForCausalLM.from_pretrained(source.model, dtype="float32").eval()
    expected = val_loss(model, Path(run_dir).parent / f"val-{Path(run_dir).name}", overrides)
    err = rel_err(first["val_loss"], expected)
    print(f"{name}: val loss at step 0 {first['val_loss']:.6f}, from_pretrained's {expected:.6f} ({err:.1e})")
    assert err < 1e-6, (first["val_loss"], expected)
    return err


def val_loss(model, run_dir, overrides) -> float:
    """The trainer's evaluation (eval.max_sequences of the validation split, token-weighted CE) of the run
    configured by `overrides`, recomputed on one process with `model`."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from tests.conftest import compose_config
    from trainer.run import build as B
    from trainer.data.datasets import IGNORE

    cfg = compose_config(list(overrides) + ["strategy=single", "train.micro_batch_size=2"])
    val = B.prepare(cfg, str(run_dir)).data.val
    n = min(len(val), cfg.eval.max_sequences) if cfg.eval.max_sequences else len(val)
    idx = np.arange(n)
    batch = val.get(idx)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    ce = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE,
                         reduction="sum")
    return ce.item() / float(val.count_targets(idx))


EXPORT_IDS = [[3, 14, 15, 92, 65, 256, 35, 89]]


def export_command(checkpoint, out_dir) -> Path:
    """`python -m trainer.export CHECKPOINT OUT_DIR`, checked to exit 0; returns OUT_DIR."""
    proc = subprocess.run([sys.executable, "-m", "trainer.export", str(checkpoint), str(out_dir)], check=False,
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    ok(proc)
    return Path(out_dir)


def generation_config(folder) -> dict:
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(folder).to_diff_dict()


def check_generation_config(folders, source) -> None:
    """Each export folder's generation_config.json is the pretrained source's (its sampling defaults and stop
    tokens: tests.conftest's generated model ships its own), whichever layout or command wrote it."""
    want = generation_config(source)
    assert want.get("do_sample") is True, want  # the source's own, not one derived from config.json
    for folder in folders:
        assert generation_config(folder) == want, (folder, generation_config(folder), want)


def check_same_export_files(folders, architecture: str = "LlamaForCausalLM") -> None:
    """Export folders written by different layouts or commands hold the same config.json, whose `architectures`
    names the causal LM class (serving stacks such as vLLM pick the model by it), and the same generation config."""
    configs = [json.loads((Path(f) / "config.json").read_text()) for f in folders]
    assert configs[0].get("architectures") == [architecture], configs[0]
    assert all(c == configs[0] for c in configs), configs
    assert all(generation_config(f) == generation_config(folders[0]) for f in folders)


def check_export(run_dir, tmp_path, overrides, name: str, final_step: int = 10):
    """hf/ (written at the end of the run) and `python -m trainer.export` of the final checkpoint give the same
    logits, config and generation config, and the exported model's validation loss is the one the trainer
    measured after the last step. Returns the model loaded from hf/."""
    import torch
    from transformers import AutoModelForCausalLM

    export_command(run_dir / "checkpoints" / f"step_{final_step}", tmp_path / "exported")
    check_same_export_files([run_dir / "hf", tmp_path / "exported"])
    at_end = AutoModelForCausalLM.from_pretrained(run_dir / "hf").eval()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    ids = torch.tensor(EXPORT_IDS)
    with torch.no_grad():
        la, lb = at_end(ids).logits, exported(ids).logits
    print(f"{name} export: max |hf/ - trainer.exporting.from_checkpoint| logit difference {(la - lb).abs().max().item():.2e}")
    torch.testing.assert_close(la, lb, rtol=0, atol=1e-6)

    trained = read_jsonl(run_dir / "eval.jsonl")[-1]
    assert trained["step"] == final_step
    got = val_loss(at_end, tmp_path / "val", overrides)
    err = rel_err(got, trained["val_loss"])
    print(f"{name} export: val loss {got:.6f} vs trainer's {trained['val_loss']:.6f} (relative error {err:.2e})")
    assert err < 1e-5, (got, trained["val_loss"])
    return at_end


def checkpoint_tensors(path) -> dict:
    """Every tensor of a checkpoint (weights, optimizer state) through DCP's public conversion."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = Path(path).parent.parent / f"{Path(path).name}.pt"
    dcp_to_torch_save(str(path), str(flat))
    import torch

    state = torch.load(flat, weights_only=False)
    out = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(f"{prefix}.{i}", v)
        elif isinstance(node, torch.Tensor):
            out[prefix] = node

    walk("", state)
    return out


def descendants(pid: int) -> list:
    """Every live process below `pid` (a launcher's agent, its ranks)."""
    from trainer.launch.torchrun import children

    out, frontier = [], [pid]
    while frontier:
        frontier = [c for p in frontier for c in children(p)]
        out += frontier
    return out


def wait_while_running(condition, what: str, procs, timeout: float = 240) -> None:
    """Poll `condition()` until it holds; fail on the timeout or when one of `procs` ends first."""
    import time

    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in procs), f"a launch ended while waiting for {what}"
        time.sleep(0.05)


def rank_pids(run_dir) -> dict:
    """{rank: pid} of the trainer processes of one run (found through /proc)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            script = b" ".join(cmd)
            if b"trainer/main.py" not in script and b"fault_worker.py" not in script or \
                    f"hydra.run.dir={run_dir}".encode() not in cmd:
                continue
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
            if b"RANK" in env:
                found[int(env[b"RANK"])] = int(pid)
        except OSError:
            continue
    return found


def kill_rank_when(proc, run_dir, ready, rank: int, deadline_s: float = 240):
    """SIGKILL rank `rank` of the run as soon as `ready()` holds (from outside the trainer, by PID)."""
    deadline = time.time() + deadline_s
    while True:
        assert proc.poll() is None and time.time() < deadline, "the run ended before the moment to kill came"
        pid = rank_pids(run_dir).get(rank)
        if pid is not None and ready():
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.02)
