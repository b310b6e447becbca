"""data.follow=true end to end (real processes): records appended to a JSONL file while the run trains are each
trained exactly once across a SIGKILL and a restart; a resumed run (also on 2 DDP ranks) continues exactly as the
uninterrupted one, replayed rows included; waiting costs no CPU; a stop signal while waiting, the idle limit and
train.max_time_s end the run with a checkpoint."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

from tests.integration.conftest import REPO, SMALL, check_parity, launch, metrics, ok, read_jsonl
from trainer.launch.choose import launcher_command

SEQ = 32
GBS = 4


def _records(start: int, n: int) -> str:
    words = "the quick brown fox jumps over a lazy dog while rivers run to the sea".split()
    return "".join(json.dumps({"text": f"record {i}: " + " ".join(words[(i + j) % len(words)]
                                                                  for j in range(4 + i % 9))}) + "\n"
                   for i in range(start, start + n))


def _offsets(path) -> list:
    out, offset = [], 0
    with open(path, "rb") as fh:
        for line in fh:
            out.append(offset)
            offset += len(line)
    return out


def _overrides(path, *extra):
    return [o for o in SMALL if not o.startswith("data.")] + [
        "strategy=single", "data=text", f"data.path={path}", "data.follow=true", f"data.seq_len={SEQ}",
        "data.follow_poll_s=0.2", f"train.global_batch_size={GBS}", "train.micro_batch_size=2",
        "train.log_every=1", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false", *extra]


def _trained(run_dir) -> list:
    """The records follow.jsonl says were trained, step by step, in order."""
    recs = read_jsonl(run_dir / "follow.jsonl")
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1))
    return [tuple(x) for r in recs for x in r["records"]]


def test_appended_records_train_exactly_once_across_a_kill_and_restart(tmp_path):
    data = tmp_path / "stream.jsonl"
    data.write_text(_records(0, 20))
    run = tmp_path / "run"
    # a model in service: a snapshot every 10 steps for readers of snapshots/current
    args = _overrides(data, "train.max_steps=400", "checkpoint.every=3", "data.follow_idle_timeout_s=4",
                      "export.snapshot_every=10")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    total = [20]
    done = threading.Event()

    def writer():  # appends records while the run lives, a line sometimes in two writes (a record being written)
        i = 0
        while not done.is_set() and total[0] < 260:
            with open(data, "a") as fh:
                chunk = _records(total[0], 10)
                if i % 3 == 0:
                    fh.write(chunk[:len(chunk) // 2])
                    fh.flush()
                    time.sleep(0.05)
                    fh.write(chunk[len(chunk) // 2:])
                else:
                    fh.write(chunk)
            total[0] += 10
            i += 1
            time.sleep(0.4)

    feeder = threading.Thread(target=writer)
    feeder.start()
    try:
        proc = subprocess.Popen(launcher_command("python") + args + [f"hydra.run.dir={run}"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.time() + 240
        while time.time() < deadline and not (run / "checkpoints" / "step_6" / "COMPLETE.json").exists():
            time.sleep(0.2)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)  # mid-stream: some records trained after the last checkpoint
        proc.communicate(timeout=60)
        killed_at = len(read_jsonl(run / "follow.jsonl"))
        second = launch("python", args + ["checkpoint.resume=auto"], run, timeout=400)
        ok(second)
    finally:
        done.set()
        feeder.join()
    assert killed_at > 6  # steps after the checkpoint were lost with the kill and are trained again, once
    log = second.stdout + second.stderr
    assert "waiting for new records" in log and "no new record in" in log
    trained = _trained(run)
    every = [("stream.jsonl", off) for off in _offsets(data)]
    print(f"follow: {len(trained)} of {len(every)} records trained over {len(read_jsonl(run / 'follow.jsonl'))} "
          f"steps, killed after step {killed_at}")
    assert len(set(trained)) == len(trained)  # none twice
    assert trained == every[:len(trained)]  # none skipped, in order
    assert len(every) - len(trained) <= 3  # what is left is less than one global batch of tokens
    steps = [r["step"] for r in metrics(run)]
    assert steps == list(range(1, steps[-1] + 1))
    from transformers import AutoModelForCausalLM

    current = os.path.realpath(run / "snapshots" / "current")
    assert current.endswith(f"step_{steps[-1] // 10 * 10}")
    AutoModelForCausalLM.from_pretrained(run / "snapshots" / "current")


@pytest.fixture(scope="module")
def static_run(tmp_path_factory):
    """All records there from the start, a quarter of each batch replayed: the uninterrupted reference."""
    root = tmp_path_factory.mktemp("follow-static")
    data = root / "data"
    data.mkdir()
    (data / "a.jsonl").write_text(_records(0, 30))
    (data / "b.jsonl").write_text(_records(30, 30))
    run = root / "run"
    ok(launch("python", _overrides(data, "train.max_steps=8", "checkpoint.every=4", "data.follow_replay=0.25"), run))
    return data, run


@pytest.mark.parametrize("launcher,nproc,strategy", [("python", 1, "single"), ("torchrun", 2, "ddp")])
def test_a_resumed_follow_run_continues_exactly(static_run, tmp_path, launcher, nproc, strategy):
    data, reference = static_run
    shutil.copytree(reference / "checkpoints" / "step_4", tmp_path / "checkpoints" / "step_4")
    ok(launch(launcher, _overrides(data, "train.max_steps=8", "checkpoint.every=4", "data.follow_replay=0.25",
                                   f"strategy={strategy}", "checkpoint.resume=auto"), tmp_path, nproc=nproc))
    got, ref = metrics(tmp_path), metrics(reference)
    assert [r["step"] for r in got] == [5, 6, 7, 8]
    if strategy == "single":
        assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in ref[4:]]
    else:
        check_parity("follow resumed on ddp", [dict(r, step=r["step"] - 4) for r in got],
                     [dict(r, step=r["step"] - 4) for r in ref[4:]], steps=4)
    assert read_jsonl(tmp_path / "follow.jsonl") == read_jsonl(reference / "follow.jsonl")[4:]
    replayed = [r["replayed_rows"] for r in read_jsonl(reference / "follow.jsonl")]
    assert replayed == [0] + [1] * 7  # nothing to replay before the first records are read


def test_waiting_costs_no_cpu_and_a_signal_stops_it_with_a_checkpoint(tmp_path):
    data = tmp_path / "few.jsonl"
    data.write_text(_records(0, 6))
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(launcher_command("python") + _overrides(data, "train.max_steps=50") +
                            [f"hydra.run.dir={run}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run / "follow.jsonl").exists():
            time.sleep(0.2)
        time.sleep(3)  # trained what there is, now waiting
        with open(f"/proc/{proc.pid}/stat") as fh:
            before = sum(int(x) for x in fh.read().split()[13:15])
        time.sleep(4)
        with open(f"/proc/{proc.pid}/stat") as fh:
            after = sum(int(x) for x in fh.read().split()[13:15])
        cpu_s = (after - before) / os.sysconf("SC_CLK_TCK")
        print(f"follow: {cpu_s:.2f} CPU seconds in 4 s of waiting")
        assert cpu_s < 0.4
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert "waiting for new records" in out and "stopped by SIGTERM" in out
    step = len(read_jsonl(run / "follow.jsonl"))
    assert (run / "checkpoints" / f"step_{step}" / "COMPLETE.json").exists()


def test_the_time_limit_stops_with_a_checkpoint(tmp_path):
    data = tmp_path / "many.jsonl"
    data.write_text(_records(0, 2000))
    proc = launch("python", _overrides(data, "train.max_steps=100000", "train.max_time_s=3"), tmp_path / "run")
    ok(proc)
    assert "train.max_time_s: stopping after step" in proc.stdout + proc.stderr
    steps = metrics(tmp_path / "run")[-1]["step"]
    assert 0 < steps < 100000 and (tmp_path / "run" / "checkpoints" / f"step_{steps}" / "COMPLETE.json").exists()
