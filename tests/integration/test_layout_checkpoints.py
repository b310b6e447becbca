"""Checkpoints of the models whose parameters are special in some layout: a mixture-of-experts model (fused 3-D
expert tensors, whole on every tensor-parallel rank, FSDP-sharded over the experts) and a tied-embedding model
under pipeline parallelism (the weight held twice, by the first and the last stage). Each is saved mid-run,
resumed under its own and another layout, and exported; tiny models from tests/archs.py, fp32."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.archs import make_model_folder
from tests.integration.conftest import FP32_TOL, REPO, launch, metrics, ok, read_jsonl, rel_err

STEPS, SAVED = 6, 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt-models")
    return {name: make_model_folder(name, root / name) for name in ("qwen3_moe", "llama_tied")}


def _overrides(folder, layout_args, resume=None):
    out = ["model=hf", f"model.name_or_path={folder}", "data=default", "data.embedded_documents=60",
           "data.seq_len=32", f"train.max_steps={STEPS}", "train.log_every=1", "train.global_batch_size=8",
           "train.micro_batch_size=2", "scheduler.warmup_steps=1", "eval.every=0", "eval.at_end=true",
           "eval.max_sequences=8", f"checkpoint.every={SAVED}", "checkpoint.keep_last=0", "checkpoint.at_end=true",
           "export.hf_at_end=true", "logging.progress=false"] + layout_args
    return out + ([f"checkpoint.resume={resume}"] if resume else [])


def _run(folder, layout_args, run_dir, resume=None):
    proc = launch("torchrun", _overrides(folder, layout_args, resume), run_dir, nproc=2)
    ok(proc)
    if resume:
        assert f"at step {SAVED}" in proc.stdout + proc.stderr
    return metrics(run_dir)


@pytest.fixture(scope="module")
def moe_tp(models, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe-tp")
    _run(models["qwen3_moe"], ["strategy=tp"], run_dir)
    return run_dir


@pytest.fixture(scope="module")
def tied_pp(models, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tied-pp")
    _run(models["llama_tied"], ["strategy=pp", "strategy.pp_schedule=1f1b"], run_dir)
    return run_dir


def _compare(name, first, resumed, exact):
    before = {r["step"]: r for r in metrics(first)}
    assert [r["step"] for r in resumed] == list(range(SAVED + 1, STEPS + 1))
    errs = [max(rel_err(r["loss"], before[r["step"]]["loss"]), rel_err(r["grad_norm"], before[r["step"]]["grad_norm"]))
            for r in resumed]
    print(f"{name}: steps {SAVED + 1}-{STEPS} after resume, max relative error {max(errs):.1e}")
    if exact:
        assert all((r["loss"], r["grad_norm"]) == (before[r["step"]]["loss"], before[r["step"]]["grad_norm"])
                   for r in resumed)
    assert max(errs) < FP32_TOL, errs


def test_moe_checkpoint_from_tensor_parallel_resumes_under_fsdp(models, moe_tp, tmp_path):
    """Experts whole on each tp rank, saved; read back as FSDP shards over the expert dimension."""
    recs = _run(models["qwen3_moe"], ["strategy=fsdp"], tmp_path, resume=moe_tp / "checkpoints" / f"step_{SAVED}")
    _compare("qwen3_moe tp -> fsdp", moe_tp, recs, exact=False)


def test_tied_pipeline_checkpoint_resumes_exactly(models, tied_pp, tmp_path):
    """The tied weight's two copies are saved under their two names; pp resumes bit-exactly. (The conversion
    between the pipeline's two copies and FSDP's one weight is the next test's, in the harder direction.)"""
    step = tied_pp / "checkpoints" / f"step_{SAVED}"
    recs = _run(models["llama_tied"], ["strategy=pp", "strategy.pp_schedule=1f1b"], tmp_path / "pp", resume=step)
    _compare("llama_tied pp -> pp", tied_pp, recs, exact=True)


def test_tied_checkpoint_of_fsdp_resumes_under_a_v_shaped_pipeline(models, tmp_path):
    """FSDP holds the tied weight once (the optimizer state under the embedding's name only): the pipeline's
    head copy takes the embedding's state. zbv: rank 0 holds the first and the last stage, so both copies."""
    first = tmp_path / "fsdp"
    _run(models["llama_tied"], ["strategy=fsdp"], first)
    recs = _run(models["llama_tied"], ["strategy=pp", "strategy.pp_schedule=zbv"], tmp_path / "pp",
                resume=first / "checkpoints" / f"step_{SAVED}")
    _compare("llama_tied fsdp -> pp (zbv)", first, recs, exact=False)


@pytest.mark.parametrize("which", ["moe_tp", "tied_pp"])
def test_export_of_the_final_checkpoint_equals_hf(request, tmp_path, which):
    """`python -m trainer.export` of the last checkpoint and the end-of-run hf/ hold the same tensors, and load
    with from_pretrained to the trainer's final validation loss."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir = request.getfixturevalue(which)
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "trainer.export", str(run_dir / "checkpoints" / f"step_{STEPS}"),
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    ok(proc)

    def tensors(folder):
        found = {}
        for f in sorted(folder.glob("*.safetensors")):
            found.update(load_file(str(f)))
        return found

    a, b = tensors(run_dir / "hf"), tensors(out)
    common = set(a) & set(b)
    assert common and all(torch.equal(a[k], b[k]) for k in common), sorted(k for k in common
                                                                          if not torch.equal(a[k], b[k]))[:5]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf").eval()
    ids = torch.arange(3, 35).reshape(1, 32)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    assert read_jsonl(run_dir / "eval.jsonl")[-1]["step"] == STEPS
