"""One run, one final model: the end-of-run hf/ export and `python -m trainer.export` of the final checkpoint
write the same tensors, in the same dtype: the fp32 master weights (not DeepSpeed's bf16 copies of a bf16 run)
cast to export.dtype."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import REPO, SMALL, launch, ok

# 3 steps of bf16 training, a checkpoint and the hf/ export at the end (both defaults), no evaluation.
BF16 = SMALL + ["train.max_steps=3", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2",
                "eval.every=0", "eval.at_end=false", "precision=bf16"]


def _tensors(folder) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    assert out, f"no safetensors in {folder}"
    return out


def _config_dtype(folder) -> str:
    return json.loads((Path(folder) / "config.json").read_text())["dtype"]


def _cli_exports(run_dir, outs: dict) -> list:
    """`python -m trainer.export <final checkpoint> <out> [flags]` for each {out: flags}, run side by side."""
    procs = [subprocess.Popen([sys.executable, "-m", "trainer.export", str(run_dir / "checkpoints" / "step_3"),
                               str(out), *flags], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for out, flags in outs.items()]
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        ok(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return [_tensors(out) for out in outs]


def _assert_identical(a: dict, b: dict, dtype: torch.dtype) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == dtype, (name, a[name].dtype, b[name].dtype)
        assert torch.equal(a[name], b[name]), name


def _assert_not_bf16_values(tensors: dict) -> None:
    """fp32 masters, not bf16 copies widened to fp32: some trained weight is not a bf16 value."""
    w = [t for n, t in tensors.items() if t.dim() == 2]
    assert any(not torch.equal(t, t.bfloat16().float()) for t in w)


# ZeRO's export from its shards (fp32 masters) is tested in test_deepspeed.py and the bf16 export per layout in
# test_architectures.py.
@pytest.mark.parametrize("launcher, strategy, nproc", [("python", "single", 1)], ids=["single"])
def test_bf16_run_exports_fp32_masters_like_trainer_export(tmp_path, launcher, strategy, nproc):
    run = tmp_path / "run"
    ok(launch(launcher, BF16 + [f"strategy={strategy}"], run, nproc=nproc))
    at_end = _tensors(run / "hf")
    (exported,) = _cli_exports(run, {tmp_path / "exported": []})
    _assert_identical(at_end, exported, torch.float32)
    _assert_not_bf16_values(at_end)
    assert _config_dtype(run / "hf") == _config_dtype(tmp_path / "exported") == "float32"


def test_zero3_export_dtype_bf16_writes_the_masters_cast_to_bf16(tmp_path):
    run = tmp_path / "run"
    ok(launch("torchrun", BF16 + ["strategy=zero3", "export.dtype=bf16"], run, nproc=2))
    at_end = _tensors(run / "hf")
    # trainer.exporting.from_checkpoint takes export.dtype from the checkpoint's config.yaml; --dtype overrides it.
    exported, masters = _cli_exports(run, {tmp_path / "exported": [], tmp_path / "fp32": ["--dtype", "fp32"]})
    _assert_identical(at_end, exported, torch.bfloat16)
    assert _config_dtype(run / "hf") == _config_dtype(tmp_path / "exported") == "bfloat16"
    # hf/ holds the fp32 masters cast to bf16.
    assert _config_dtype(tmp_path / "fp32") == "float32"
    _assert_not_bf16_values(masters)
    _assert_identical(at_end, {n: t.bfloat16() for n, t in masters.items()}, torch.bfloat16)
