"""trainer/parallel/sync.py on one worker (no process group): DiLoCo's outer Nesterov step against its formula, the
overlapped round applied one round late without losing progress, and the state a checkpoint keeps."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from trainer.parallel.sync import EveryStep, PeriodicSync, Worker


def _cfg(name, every, overlap=False, outer_lr=0.7, outer_momentum=0.9):
    return SimpleNamespace(sync=SimpleNamespace(name=name, every=every, overlap=overlap, outer_lr=outer_lr,
                                                outer_momentum=outer_momentum))


def _step(x, d):
    with torch.no_grad():
        x.add_(d)


def test_diloco_outer_step_is_nesterov_sgd_on_the_change():
    x = torch.zeros(3)
    sync = PeriodicSync(_cfg("diloco", 2), Worker({"w": x}, None, 1))
    _step(x, torch.tensor([1.0, 2.0, -1.0]))
    sync.after_step(1)
    assert torch.equal(x, torch.tensor([1.0, 2.0, -1.0]))  # mid round: untouched
    _step(x, torch.tensor([1.0, 0.0, 0.0]))
    sync.after_step(2)
    # change d = (2, 2, -1); pseudo-gradient -d; first Nesterov step: -(lr * (1 + momentum)) * (-d)
    expected = 0.7 * 1.9 * torch.tensor([2.0, 2.0, -1.0])
    assert torch.allclose(x, expected, rtol=1e-6) and torch.allclose(sync.anchor["w"], expected, rtol=1e-6)


def test_one_worker_local_sgd_with_overlap_keeps_every_update():
    x, plain = torch.zeros(4), torch.zeros(4)
    sync = PeriodicSync(_cfg("local_sgd", 1, overlap=True), Worker({"w": x}, None, 1))
    for k in range(6):
        d = torch.full((4,), float(k + 1)) * torch.tensor([1.0, -1.0, 0.5, 2.0])
        _step(x, d)
        _step(plain, d)
        sync.after_step(k + 1)
        assert torch.allclose(x, plain, rtol=1e-6), k  # the late round moves the anchor, not the progress


@pytest.mark.parametrize("name,overlap", [("diloco", False), ("diloco", True), ("local_sgd", True)])
def test_state_dict_resumes_mid_round(name, overlap):
    def run(steps, resume_from=None):
        x = torch.zeros(2)
        sync = PeriodicSync(_cfg(name, 2, overlap), Worker({"w": x}, None, 1))
        start = 0
        if resume_from is not None:
            state, weights, start = resume_from
            x.copy_(weights)
            assert sync.load_local_state(state) == ""
        saved = None
        for k in range(start, steps):
            _step(x, torch.tensor([k + 1.0, -0.5 * k]))
            sync.after_step(k + 1)  # the loop's step count: the boundaries never drift
            if k + 1 == 3:
                saved = (copy.deepcopy(sync.local_state()), x.clone(), k + 1)  # as a checkpoint file holds it
        return x, saved

    straight, saved = run(7)
    resumed, _ = run(7, resume_from=saved)
    assert torch.equal(straight, resumed)


def test_every_step_is_inert_and_a_new_world_size_restarts_the_round_from_the_weights():
    every = EveryStep()
    assert every.grad_weight == 1.0 and every.local_state() == {} and every.load_local_state(None) == ""
    x = torch.ones(2)
    sync = PeriodicSync(_cfg("diloco", 2), Worker({"w": x}, None, 1))
    with torch.no_grad():
        x.fill_(5.0)  # the checkpoint's model, loaded by the strategy
    notice = sync.load_local_state(None)  # no file for this rank: saved at another world size
    assert "another world size" in notice and torch.equal(sync.anchor["w"], x)
