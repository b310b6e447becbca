"""Stop requests: every rank stops after the same step, whichever rank the signal reached."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

import stop_worker  # tests/unit/resilience/stop_worker.py: the spawned ranks import it, not this module
from trainer.run.loss import to_device


@pytest.mark.parametrize("world_size,signal_rank", [(2, 1), (4, 2)])
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path, world_size, signal_rank):
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=stop_worker.run,
                         args=(r, world_size, str(tmp_path / "store"), signal_rank, 3, 5, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for r in range(world_size):
        assert results[r]["agreed"] == [False, False, True, True, True], (r, results[r])
        assert results[r]["name"] == "SIGTERM"  # ranks the signal never reached stop as if it had
        assert results[r]["own_group"] is False  # the default group is already gloo: no second one


def test_a_limit_on_one_rank_stops_every_rank_and_is_named_as_a_limit(tmp_path):
    """train.max_time_s reached on rank 1 only: every rank stops after the same step, and rank 0 (which logs) says it
    was a limit, not a signal."""
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=stop_worker.run, args=(r, 2, str(tmp_path / "store"), 1, 3, 5, results, "limit"))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert results[0]["agreed"] == results[1]["agreed"] == [False, False, True, True, True]
    assert results[1]["name"] == "train.max_time_s"
    assert results[0]["name"] == "another rank's limit (train.max_time_s)"


def test_to_device_leaves_cpu_tensors_alone_and_pins_for_an_accelerator():
    ids = torch.arange(8).view(2, 4)
    assert to_device(ids, torch.device("cpu")) is ids
    if torch.cuda.is_available():
        moved = to_device(ids, torch.device("cuda"))
        assert moved.is_cuda and torch.equal(moved.cpu(), ids)
