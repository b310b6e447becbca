"""Crafted payloads through every loading path of the real entry points: no code from a file ever runs.

One small real checkpoint per format is saved once per module (a single-process DCP one, a ZeRO-2 one at world
size 2); each case copies it, swaps one file for a payload that would create a marker file if code ran, and
rewrites COMPLETE.json's size and SHA-256 of that file (as an attacker could), so the payload reaches the
unpickler. Each case must exit 2 with one message naming the file, no traceback, and no marker.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.integration.catalogue import Timer, check_case
from tests.integration.conftest import REPO, SMALL, launch, ok
from tests.payloads import SystemCall, stack_global_call

BASE = SMALL + ["eval.every=0", "eval.at_end=false", "export.hf_at_end=false", "train.global_batch_size=8",
                "train.micro_batch_size=2"]


def dotted_name_payload(command: str) -> bytes:
    """STACK_GLOBAL('torch.distributed.checkpoint.filesystem', 'os.system')(command): protocol 4 resolves the
    dotted name inside a module whose name starts as DCP's do."""
    return stack_global_call("torch.distributed.checkpoint.filesystem", "os.system", command)


def torch_payload(path, command: str) -> None:
    torch.save({"optimizer_state_dict": SystemCall(command), "torch": torch.ones(1)}, path)


def craft(checkpoint, dest, rel: str, write) -> str:
    """A copy of `checkpoint` under dest/checkpoints/ with `rel` replaced by write(path); COMPLETE.json's entry
    for it (size, and SHA-256 when the checkpoint has them) is rewritten to match."""
    out = dest / "checkpoints" / os.path.basename(str(checkpoint))
    shutil.copytree(checkpoint, out)
    target = out / rel
    target.unlink()
    write(target)
    complete_path = out / "COMPLETE.json"
    complete = json.loads(complete_path.read_text())
    complete["files"][rel] = target.stat().st_size
    if complete.get("sha256"):
        complete["sha256"][rel] = hashlib.sha256(target.read_bytes()).hexdigest()
    complete_path.write_text(json.dumps(complete))
    return str(out)


def export(checkpoint, out_dir):
    return subprocess.run([sys.executable, "-m", "trainer.export", str(checkpoint), str(out_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dcp")
    ok(launch("python", BASE + ["strategy=single", "train.max_steps=1"], run_dir))
    return run_dir / "checkpoints" / "step_1"


@pytest.fixture(scope="module")
def zero_checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("zero2")
    ok(launch("torchrun", BASE + ["strategy=zero2", "train.max_steps=1"], run_dir, nproc=2, timeout=600))
    return run_dir / "checkpoints" / "step_1"


def _assert_refused(case, proc, seconds, marker, expected):
    message = check_case(case, proc, seconds, 2, expected)
    assert not marker.exists(), f"{case}: code from the file ran"
    return message


DOTTED = "refers to torch.distributed.checkpoint.filesystem.os.system"
SYSTEM = "it refers to posix.system"


def test_dcp_metadata_payload_on_resume_and_export(dcp_checkpoint, tmp_path):
    marker = tmp_path / "code-ran"
    ckpt = craft(dcp_checkpoint, tmp_path / "crafted", ".metadata",
                 lambda p: p.write_bytes(dotted_name_payload(f"touch {marker}")))
    with Timer() as t:
        proc = launch("python", BASE + ["strategy=single", "train.max_steps=2", f"checkpoint.resume={ckpt}"],
                      tmp_path / "run", timeout=300)
    _assert_refused("payload: DCP .metadata (dotted global), resume", proc, t.seconds, marker,
                    f"{ckpt}/.metadata {DOTTED}")
    with Timer() as t:
        proc = export(ckpt, tmp_path / "out")
    _assert_refused("payload: DCP .metadata (dotted global), trainer.exporting.from_checkpoint", proc, t.seconds, marker,
                    f"{ckpt}/.metadata {DOTTED}")
    assert not (tmp_path / "out").exists()


def test_rng_state_payload_on_resume(dcp_checkpoint, tmp_path):
    marker = tmp_path / "code-ran"
    ckpt = craft(dcp_checkpoint, tmp_path / "crafted", "rng/rank_0.pt",
                 lambda p: torch_payload(p, f"touch {marker}"))
    with Timer() as t:
        proc = launch("python", BASE + ["strategy=single", "train.max_steps=2", f"checkpoint.resume={ckpt}"],
                      tmp_path / "run", timeout=300)
    _assert_refused("payload: rng/rank_0.pt, resume", proc, t.seconds, marker,
                    f"RNG state file {ckpt}/rng/rank_0.pt: {SYSTEM}")


def test_pretrained_bin_payload(dcp_checkpoint, tmp_path):
    marker = tmp_path / "code-ran"
    model_dir = tmp_path / "model"
    shutil.copytree(dcp_checkpoint / "hf_config", model_dir)
    torch_payload(model_dir / "pytorch_model.bin", f"touch {marker}")
    with Timer() as t:
        proc = launch("python", BASE + ["strategy=single", "train.max_steps=1", "model=hf",
                                        f"model.name_or_path={model_dir}"], tmp_path / "run", timeout=300)
    _assert_refused("payload: pretrained pytorch_model.bin (model=hf)", proc, t.seconds, marker,
                    f"{model_dir}/pytorch_model.bin: {SYSTEM}")


ZERO_FILE = "zero/zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.mark.parametrize("nproc", [2, 1], ids=["same-dp-size", "universal-conversion"])
def test_deepspeed_payload_on_resume(zero_checkpoint, tmp_path, nproc):
    marker = tmp_path / "code-ran"
    ckpt = craft(zero_checkpoint, tmp_path / "crafted", ZERO_FILE, lambda p: torch_payload(p, f"touch {marker}"))
    with Timer() as t:
        # launch.sh's torchrun: the rank's exit code and one message (raw torchrun exits 1 with its own traceback)
        proc = launch("torchrun-quiet", BASE + ["strategy=zero2", "train.max_steps=2", f"checkpoint.resume={ckpt}"],
                      tmp_path / "run", nproc=nproc, timeout=600)
    _assert_refused(f"payload: ZeRO-2 optimizer file, resume at world size {nproc}", proc, t.seconds, marker,
                    f"DeepSpeed checkpoint file {ckpt}/{ZERO_FILE}: {SYSTEM}")


def test_deepspeed_payload_on_export(zero_checkpoint, tmp_path):
    marker = tmp_path / "code-ran"
    ckpt = craft(zero_checkpoint, tmp_path / "crafted", ZERO_FILE, lambda p: torch_payload(p, f"touch {marker}"))
    with Timer() as t:
        proc = export(ckpt, tmp_path / "out")
    _assert_refused("payload: ZeRO-2 optimizer file, trainer.exporting.from_checkpoint", proc, t.seconds, marker,
                    f"DeepSpeed checkpoint file {ckpt}/{ZERO_FILE}: {SYSTEM}")


def test_real_zero_checkpoint_still_exports(zero_checkpoint, tmp_path):
    """The checks admit what DeepSpeed really writes."""
    ok(export(zero_checkpoint, tmp_path / "out"))
    assert (tmp_path / "out" / "config.json").is_file()
