"""Checkpoints: exact resume, resume on another world size, atomic saves under SIGKILL, preemption by SIGTERM,
damaged and incompatible checkpoints, a full disk, and export from a checkpoint."""
from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.catalogue import check_case
from tests.integration.conftest import (REPO, SMALL, VENV_BIN, checkpoint_tensors, free_port, kill_rank_when, launch,
                                       metrics, ok, rank_pids, rel_err)

FAULT_WORKER = REPO / "tests" / "integration" / "fault_worker.py"  # trainer/main.py, paused inside one save

# About 11 global batches per epoch: 16 steps cross an epoch boundary. Accumulation 4 on one process.
BASE = SMALL + ["data.embedded_documents=12", "train.global_batch_size=8", "train.micro_batch_size=2",
                "train.log_every=1", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false",
                "train.max_steps=16", "checkpoint.keep_last=0"]


def _curve(run_dir, key="loss"):
    return {r["step"]: r[key] for r in metrics(run_dir)}


def _ckpts(run_dir):
    root = Path(run_dir) / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def _assert_same(run_dir, reference, first_step: int, exact: bool):
    got, ref = _curve(run_dir), _curve(reference)
    got_norm, ref_norm = _curve(run_dir, "grad_norm"), _curve(reference, "grad_norm")
    steps = [s for s in sorted(got) if s >= first_step]
    assert steps == list(range(first_step, 17)), steps
    if exact:
        assert [got[s] for s in steps] == [ref[s] for s in steps]
        assert [got_norm[s] for s in steps] == [ref_norm[s] for s in steps]
    else:
        loss_err = max(rel_err(got[s], ref[s]) for s in steps)
        norm_err = max(rel_err(got_norm[s], ref_norm[s]) for s in steps)
        print(f"{run_dir.name}: max relative loss error {loss_err:.2e}, grad-norm error {norm_err:.2e}")
        assert loss_err < 1e-5 and norm_err < 1e-5, (loss_err, norm_err)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """16 uninterrupted steps on one process, no checkpoints: the reference."""
    run_dir = tmp_path_factory.mktemp("straight")
    ok(launch("python", BASE + ["strategy=single", "checkpoint.at_end=false"], run_dir))
    assert max(r["epoch"] for r in metrics(run_dir)) == 1  # the run crosses an epoch boundary
    return run_dir


@pytest.fixture(scope="module")
def ddp2(tmp_path_factory):
    """16 steps with DDP on 2 ranks (accumulation 2), checkpoints at 6 and 12 (and 16, at the end)."""
    run_dir = tmp_path_factory.mktemp("ddp2")
    ok(launch("torchrun", BASE + ["strategy=ddp", "checkpoint.every=6"], run_dir, nproc=2))
    return run_dir


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_single_resume_is_bit_exact(straight, tmp_path, async_save):
    flag = f"checkpoint.async_save={str(async_save).lower()}"
    first = tmp_path / "first"
    ok(launch("python", BASE + ["strategy=single", "checkpoint.every=6", flag], first))
    assert _ckpts(first) == ["latest", "step_12", "step_16", "step_6"]
    assert (first / "checkpoints" / "latest").read_text().strip() == "step_16"
    _assert_same(first, straight, 1, exact=True)  # saving does not disturb training
    resumed = tmp_path / "resumed"
    proc = launch("python", BASE + ["strategy=single", flag, f"checkpoint.resume={first / 'checkpoints' / 'step_6'}"],
                  resumed)
    ok(proc)
    assert "resumed from" in proc.stdout + proc.stderr
    _assert_same(resumed, straight, 7, exact=True)


def test_ddp_resume_is_bit_exact(ddp2, tmp_path):
    shutil.copytree(ddp2 / "checkpoints" / "step_6", tmp_path / "checkpoints" / "step_6")
    ok(launch("torchrun", BASE + ["strategy=ddp", "checkpoint.resume=auto"], tmp_path, nproc=2))
    _assert_same(tmp_path, ddp2, 7, exact=True)


@pytest.mark.parametrize("launcher,nproc,strategy,optimizer", [
    ("python", 1, "single", "adafactor"),  # a step count and an eps pair of its own in each group
    ("torchrun", 2, "zero2", "adamw_8bit"),  # bitsandbytes' uint8 moments in DeepSpeed's partitioned state
    ("torchrun", 2, "fsdp", "muon"),  # DTensor momentum beside AdamW's moments, one optimizer in DCP
], ids=["single-adafactor", "zero2-adamw_8bit", "fsdp-muon"])
def test_the_other_optimizers_resume_bit_exact(tmp_path, launcher, nproc, strategy, optimizer):
    """6 steps with a checkpoint at 3, and a run resumed from it: steps 4-6 have the same loss and grad norm."""
    run = BASE + [f"strategy={strategy}", f"optim={optimizer}", "train.max_steps=6"]
    ok(launch(launcher, run + ["checkpoint.every=3", "checkpoint.at_end=false"], tmp_path / "first", nproc=nproc))
    shutil.copytree(tmp_path / "first" / "checkpoints" / "step_3", tmp_path / "resumed" / "checkpoints" / "step_3")
    ok(launch(launcher, run + ["checkpoint.resume=auto", "checkpoint.at_end=false"], tmp_path / "resumed",
              nproc=nproc))
    got, ref = metrics(tmp_path / "resumed"), {r["step"]: r for r in metrics(tmp_path / "first")}
    assert [r["step"] for r in got] == [4, 5, 6]
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(ref[r["step"]]["loss"], ref[r["step"]]["grad_norm"])
                                                          for r in got]


@pytest.mark.parametrize("nproc,micro", [(1, 2), (4, 1)], ids=["to-ws1", "to-ws4"])
def test_resume_on_another_world_size(straight, ddp2, tmp_path, nproc, micro):
    proc = launch("torchrun", BASE + ["strategy=ddp", f"train.micro_batch_size={micro}",
                                      f"checkpoint.resume={ddp2 / 'checkpoints' / 'step_6'}"], tmp_path, nproc=nproc)
    ok(proc)
    assert f"saved at world size 2, now {nproc}" in proc.stdout + proc.stderr
    _assert_same(tmp_path, straight, 7, exact=False)


def _logged_steps(run_dir) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


RESTART_MOMENTS = {
    # moment: (launcher, rank killed, when)
    "in-step": ("launch.sh", 1, lambda run_dir: _logged_steps(run_dir) >= 8),
    "in-save": ("fault-worker", 0, lambda run_dir: (run_dir / "checkpoints" / ".tmp-step_12" / "rng" /
                                                    "rank_0.pt").exists()),
    "start-up": ("deepspeed-wrapper", 1, lambda run_dir: True),
    # torchrun itself (docs/fault-tolerance.md): its own restarts and agent store
    "torchrun-max-restarts": ("torchrun", 1, lambda run_dir: _logged_steps(run_dir) >= 8),
}


@pytest.mark.parametrize("moment", RESTART_MOMENTS)
def test_a_killed_rank_restarts_and_the_run_ends_as_if_never_interrupted(ddp2, tmp_path, moment):
    """SIGKILL one rank of a 2-rank DDP run inside a step, inside a save (rank 0, the save of step 12 paused
    half-written) or during start-up, through each of launch.sh's launchers and plain `torchrun --max-restarts`
    (whose agent keeps one store across attempts): the launch restarts by itself, the
    ranks continue from the newest complete checkpoint, and the finished run is bit for bit the uninterrupted
    one: every logged loss and gradient norm, one record per step, and every tensor of the final checkpoint."""
    launcher, rank, ready = RESTART_MOMENTS[moment]
    run_dir = tmp_path / "run"
    args = BASE + ["strategy=ddp", "checkpoint.every=6", f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TESSERA_MAX_RESTARTS="2")
    if launcher == "launch.sh":
        venv = os.path.dirname(os.path.dirname(sys.executable))
        env.update(NPROC_PER_NODE="2", TESSERA_VENV=venv)
        env.pop("TESSERA_MAX_RESTARTS")  # launch.sh sets it from train.max_restarts
        cmd = [str(REPO / "launch.sh"), "train.max_restarts=2"] + args
    elif launcher == "fault-worker":
        cmd = [sys.executable, "-m", "trainer.torchrun", "--nproc_per_node=2", f"--master_port={free_port()}",
               str(FAULT_WORKER), "--pause-save=12:60"] + args
    elif launcher == "torchrun":
        cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node=2", "--max-restarts=2", f"--master_port={free_port()}",
               str(REPO / "trainer" / "main.py")] + args
    else:
        cmd = [sys.executable, "-m", "trainer.launch.deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
               str(REPO / "trainer" / "main.py")] + args
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        kill_rank_when(proc, run_dir, lambda: ready(run_dir), rank)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"STDOUT:\n{out[-3000:]}\nSTDERR:\n{err[-3000:]}"
    if launcher != "torchrun":  # Tessera's launchers say so; torchrun restarts silently
        assert "restarting the ranks (1 of 2)" in err, err[-3000:]
        assert "restarting the ranks (2 of 2)" not in err
    resumed_from = "step 0 (no complete checkpoint yet)" if moment == "start-up" else "its checkpoint of step 6"
    assert f"restart 1: continuing the run in {run_dir} from {resumed_from}" in out, out[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 17))  # one series, no step twice
    _assert_same(run_dir, ddp2, 1, exact=True)
    assert _ckpts(run_dir) == ["latest", "step_12", "step_16", "step_6"]  # the partial save was cleaned up
    got, want = checkpoint_tensors(run_dir / "checkpoints" / "step_16"), \
        checkpoint_tensors(ddp2 / "checkpoints" / "step_16")
    assert got.keys() == want.keys() and len(got) > 10
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


def test_a_killed_single_process_run_restarts_through_launch_sh(straight, tmp_path):
    """strategy=single through launch.sh has restarts too (trainer/launch/single.py): the trainer SIGKILLed after
    step 8 starts again from its step-6 checkpoint and ends with the uninterrupted run's losses, bit for bit."""
    from trainer.launch.torchrun import children

    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TESSERA_VENV=os.path.dirname(os.path.dirname(sys.executable)))
    cmd = [str(REPO / "launch.sh"), "train.max_restarts=2"] + BASE + ["strategy=single", "checkpoint.every=6",
                                                                     f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 240
        while _logged_steps(run_dir) < 8:
            assert proc.poll() is None and time.time() < deadline, "the run ended before the moment to kill came"
            time.sleep(0.02)
        trainer, = children(proc.pid)  # launch.sh became the supervisor; its one child is the trainer
        os.kill(trainer, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"STDOUT:\n{out[-3000:]}\nSTDERR:\n{err[-3000:]}"
    assert f"the trainer (pid {trainer}) was killed by SIGKILL" in err and "restarting the ranks (1 of 2)" in err, err
    assert f"restart 1: continuing the run in {run_dir} from its checkpoint of step 6" in out + err, out[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 17))
    _assert_same(run_dir, straight, 1, exact=True)


def _start_with_timed_stderr(cmd, env):
    """Popen whose stderr lines are collected with the time they arrived: (process, [(monotonic time, line)])."""
    import threading

    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in proc.stderr),
                              daemon=True)
    reader.start()
    proc.reader = reader
    return proc, lines


def _finish(proc, timeout=300) -> str:
    try:
        out = proc.stdout.read()
        proc.wait(timeout=timeout)
        proc.reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return out


@pytest.mark.parametrize("fault", ["sigstop", "hang"])
def test_a_stalled_rank_is_detected_named_and_the_job_recovers(ddp2, tmp_path, fault):
    """sigstop: rank 1 is stopped (SIGSTOP) after step 8; rank 0's collective times out after
    train.collective_timeout_s=8, it names rank 1 (pid, step) and exits 4. hang: every rank sleeps after step 8 in
    no collective (a stuck file system); each rank's progress watchdog ends it after 8 + 4 s. Either way the launcher
    ends the rest (the stopped rank by SIGKILL), restarts, and the run ends as the uninterrupted one, with no
    checkpoint half-written."""
    run_dir = tmp_path / "run"
    script = [str(REPO / "trainer" / "main.py")] if fault == "sigstop" else [str(FAULT_WORKER), "--hang-after=8"]
    cmd = [sys.executable, "-m", "trainer.torchrun", "--nproc_per_node=2", f"--master_port={free_port()}"] + script + \
        BASE + ["strategy=ddp", "checkpoint.every=6", "train.collective_timeout_s=8", f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TESSERA_MAX_RESTARTS="1",
               TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5")
    proc, lines = _start_with_timed_stderr(cmd, env)
    stopped = None
    try:
        deadline = time.time() + 240
        while _logged_steps(run_dir) < 8:
            assert proc.poll() is None and time.time() < deadline, "the run ended before step 8"
            time.sleep(0.02)
        t_fault = time.monotonic()
        if fault == "sigstop":
            stopped = rank_pids(run_dir)[1]
            os.kill(stopped, signal.SIGSTOP)
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = "".join(line for _, line in lines)
    assert proc.returncode == 0, f"STDOUT:\n{out[-3000:]}\nSTDERR:\n{err[-4000:]}"
    marker = "a collective timed out" if fault == "sigstop" else "no progress for"
    seen = [(t, line) for t, line in lines if marker in line]
    assert seen, err[-4000:]
    t_seen, line = seen[0]
    if fault == "sigstop":
        assert line.startswith("[rank 0] error: ") and "train.collective_timeout_s=8" in line, line
        assert f"stalled: rank 1 (pid {stopped} on " in line and "step" in line, line
    else:
        assert "after step 8" in line, line  # each rank's watchdog fires; whichever is last finds the other gone
    print(f"{fault}: detected {t_seen - t_fault:.1f} s after the fault: {line.strip()}")
    assert t_seen - t_fault < 12 + 15  # the timeout (x1.5 for the watchdog), heartbeats, a loaded machine's slack
    assert "restarting the ranks (1 of 1)" in err
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 17))
    _assert_same(run_dir, ddp2, 1, exact=True)
    assert _ckpts(run_dir) == ["latest", "step_12", "step_16", "step_6"]


def test_sigterm_saves_and_exits_cleanly_then_resume_matches(straight, tmp_path):
    main = [sys.executable, str(REPO / "trainer" / "main.py")] + BASE + ["strategy=single",
                                                                          f"hydra.run.dir={tmp_path}"]
    proc = subprocess.Popen(main, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics_file = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    stopped_at = metrics(tmp_path)[-1]["step"]
    assert stopped_at < 16 and "stopped by SIGTERM" in out
    assert f"step_{stopped_at}" in _ckpts(tmp_path)
    ok(launch("python", BASE + ["strategy=single", "checkpoint.resume=auto"], tmp_path))
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, 17))  # appended, no step twice
    _assert_same(tmp_path, straight, 1, exact=True)


def _expect_error(proc, text, code=2):
    check_case(f"checkpoint: {text}", proc, getattr(proc, "seconds", 0.0), code, text)


def test_damaged_checkpoints_are_refused_clearly(ddp2, tmp_path):
    truncated = tmp_path / "truncated"
    shutil.copytree(ddp2 / "checkpoints" / "step_6", truncated)
    shard = next(truncated.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    _expect_error(launch("python", BASE + ["strategy=single", f"checkpoint.resume={truncated}"], tmp_path / "a"),
                  "is damaged")

    garbled = tmp_path / "garbled"
    shutil.copytree(ddp2 / "checkpoints" / "step_6", garbled)
    meta = garbled / ".metadata"
    meta.write_bytes(bytes(len(meta.read_bytes())))  # same size, all zeros: passes the size check
    _expect_error(launch("python", BASE + ["strategy=single", f"checkpoint.resume={garbled}"], tmp_path / "b"),
                  "cannot load checkpoint")

    unsealed = tmp_path / "unsealed"
    shutil.copytree(ddp2 / "checkpoints" / "step_6", unsealed)
    (unsealed / "COMPLETE.json").unlink()
    _expect_error(launch("python", BASE + ["strategy=single", f"checkpoint.resume={unsealed}"], tmp_path / "c"),
                  "incomplete checkpoint")
    _expect_error(launch("python", BASE + ["strategy=single", f"checkpoint.resume={tmp_path / 'missing'}"],
                         tmp_path / "d"), "no such path")


def test_incompatible_checkpoints_are_refused_and_weights_only_works(ddp2, tmp_path):
    step6 = ddp2 / "checkpoints" / "step_6"
    _expect_error(launch("python", BASE + ["strategy=single", "model.num_layers=3", f"checkpoint.resume={step6}"],
                         tmp_path / "a"), "the checkpoint holds another model")
    _expect_error(launch("python", BASE + ["strategy=single", "train.global_batch_size=4",
                                           f"checkpoint.resume={step6}"], tmp_path / "b"),
                  "train.global_batch_size=4 but the checkpoint was saved with 8")
    _expect_error(launch("python", BASE + ["strategy=single", "optim=sgd", f"checkpoint.resume={step6}"],
                         tmp_path / "c"), "optim.name='sgd' but the checkpoint was trained with 'adamw'")
    # Weights only: a new run (other optimizer, other batch) starts at step 0 from the checkpoint's weights.
    proc = launch("python", BASE + ["strategy=single", "optim=sgd", "train.global_batch_size=4",
                                    "checkpoint.load_weights_only=true", f"checkpoint.resume={step6}",
                                    "train.max_steps=2", "eval.at_start=true"], tmp_path / "d")
    ok(proc)
    assert [r["step"] for r in metrics(tmp_path / "d")] == [1, 2]
    fresh = launch("python", BASE + ["strategy=single", "optim=sgd", "train.global_batch_size=4",
                                     "train.max_steps=2", "eval.at_start=true"], tmp_path / "e")
    ok(fresh)
    from tests.integration.conftest import read_jsonl

    from_ckpt = read_jsonl(tmp_path / "d" / "eval.jsonl")[0]["val_loss"]
    from_scratch = read_jsonl(tmp_path / "e" / "eval.jsonl")[0]["val_loss"]
    assert from_ckpt < from_scratch - 0.1  # the trained weights were really loaded


def test_full_disk_during_save_keeps_earlier_checkpoints(ddp2, tmp_path):
    shutil.copytree(ddp2 / "checkpoints" / "step_6", tmp_path / "checkpoints" / "step_6")
    before = sorted((p.name, p.stat().st_size) for p in (tmp_path / "checkpoints" / "step_6").rglob("*"))
    shard_size = max(p.stat().st_size for p in (tmp_path / "checkpoints" / "step_6").glob("*.distcp"))

    def small_files():  # every write past this size fails, as on a full disk (EFBIG instead of ENOSPC)
        resource.setrlimit(resource.RLIMIT_FSIZE, (shard_size // 2, shard_size // 2))

    cmd = [sys.executable, str(REPO / "trainer" / "main.py")] + BASE + [
        "strategy=single", "checkpoint.resume=auto", "checkpoint.every=6", f"hydra.run.dir={tmp_path}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=180, preexec_fn=small_files)
    proc.seconds = time.perf_counter() - t0
    _expect_error(proc, "saving the checkpoint of step 12 failed", code=4)  # a fault while running
    assert "earlier checkpoints are intact" in proc.stderr
    assert _ckpts(tmp_path) == ["step_6"]  # nothing partial left behind
    assert sorted((p.name, p.stat().st_size) for p in (tmp_path / "checkpoints" / "step_6").rglob("*")) == before
    ok(launch("python", BASE + ["strategy=single", "checkpoint.resume=auto", "checkpoint.at_end=false"], tmp_path))


def test_export_from_checkpoint_matches_trained_model(tmp_path):
    """Train in-process, save, export with `python -m trainer.export`: the export's logits equal the model's."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import compose_config
    from trainer.run import build as B
    from trainer.run.loop import fit

    cfg = compose_config(BASE + ["strategy=single", "train.max_steps=3"])
    run = B.build(B.prepare(cfg, str(tmp_path)))
    try:
        fit(run)
        model = run.strategy.unwrapped().eval()
    finally:
        B.close(run)
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "trainer.export", str(tmp_path), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    ok(proc)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 77, 104, 32, 97, 256, 66, 12]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
