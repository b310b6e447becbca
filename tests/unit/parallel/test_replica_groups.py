"""torchft replica groups without a launch: the cross-group normalisation against autograd, the state a
recovering group copies, the data coordinates, the launcher choice and the checks before any process group."""
from __future__ import annotations

import io
import socket
import time

import pytest
import torch
import torch.nn.functional as F

from tessera.errors import TesseraError
from tests.conftest import compose_config
from trainer.launch import choose as launch_plan
from trainer.parallel.dims import ParallelDims
from trainer.config import compat
from trainer.strategies import strategy_class
from trainer.parallel import replica_groups
from trainer.parallel.replica_groups import ReplicaGroups

pytest.importorskip("torchft", reason="torchft publishes wheels for Linux x86_64 only")

FT = ["strategy.fault_tolerance=torchft", "strategy.lighthouse=http://127.0.0.1:29510"]


class _Done:
    def wait(self):
        return True


class _OtherGroups:
    """torchft's Manager as far as reduce() uses it: the SUM all-reduce with the live groups' buffers."""

    def __init__(self, buffers):
        self.buffers = buffers

    def allreduce(self, tensor, reduce_op):
        for other in self.buffers:
            tensor += other
        return _Done()


def _replicas(other_buffers) -> ReplicaGroups:
    r = object.__new__(ReplicaGroups)  # no lighthouse: only the reduction is under test
    r.manager = _OtherGroups(other_buffers)
    return r


def _group_grads(model, tokens, targets, n_target):
    """One group's step as the trainer computes it: its token-CE sum divided by the *global* batch's tokens."""
    model.zero_grad()
    ce = F.cross_entropy(model(tokens), targets, reduction="sum")
    (ce / n_target).backward()
    return [p.grad.clone() for p in model.parameters()], ce.detach()


def _buffer(grads, loss_sum, tokens):
    return torch.cat([g.reshape(-1) for g in grads] + [loss_sum.reshape(1), torch.tensor([float(tokens)])])


@pytest.mark.parametrize("live", [(0, 1), (0,)], ids=["both-groups", "one-group-down"])
def test_the_step_is_the_mean_over_the_tokens_the_live_groups_trained(live):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11))
    data = [(torch.randint(0, 11, (7,)), torch.randint(0, 11, (7,))),  # group 0: 7 target tokens
            (torch.randint(0, 11, (3,)), torch.randint(0, 11, (3,)))]  # group 1: 3 (unequal shares)
    n_target = 10
    per_group = [_group_grads(model, x, y, n_target) for x, y in data]
    mine_grads, mine_loss = per_group[0]
    others = [_buffer(*per_group[g], len(data[g][1])) for g in live if g != 0]
    replicas = _replicas(others)
    replicas.reduce(mine_grads, mine_loss, len(data[0][1]), n_target)

    # What it must equal: the mean token cross-entropy over the live groups' tokens, differentiated directly.
    model.zero_grad()
    x = torch.cat([data[g][0] for g in live])
    y = torch.cat([data[g][1] for g in live])
    loss = F.cross_entropy(model(x), y, reduction="mean")
    loss.backward()
    for got, p in zip(mine_grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-6, atol=1e-7)
    assert replicas.tokens == len(y)
    assert replicas.loss_sum / replicas.tokens == pytest.approx(loss.item(), rel=1e-6)


def _sent(state):
    """Through serialisation, as torchft's checkpoint transport sends it (no tensor shared with the sender)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_recovering_group_gets_the_model_and_optimizer_state_of_a_live_one():
    torch.manual_seed(0)
    live, fresh = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    live_opt = torch.optim.AdamW(live.parameters(), lr=0.1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)  # no state yet (a group that starts fresh)
    for _ in range(3):
        live(torch.randn(2, 4)).square().sum().backward()
        live_opt.step()
        live_opt.zero_grad()
    replica_groups.copy_into_module(fresh, _sent(replica_groups.local_tensors(live.state_dict())))
    replica_groups.load_optimizer_state(fresh_opt, _sent(replica_groups.local_optimizer_state(live_opt)))
    assert all(torch.equal(a, b) for a, b in zip(live.parameters(), fresh.parameters()))
    for p_live, p_fresh in zip(live.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(live_opt.state[p_live][key], fresh_opt.state[p_fresh][key])
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    # Both now take the same step.
    batch = torch.randn(2, 4)
    for model, opt in ((live, live_opt), (fresh, fresh_opt)):
        model(batch).square().sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(live.parameters(), fresh.parameters()))


def test_a_peer_state_that_does_not_fit_is_refused_by_name():
    with pytest.raises(TesseraError, match="lacks"):
        replica_groups.copy_into_module(torch.nn.Linear(4, 3), {"weight": torch.zeros(3, 4)})


def test_groups_take_consecutive_data_parallel_ranks():
    cfg = compose_config(["strategy=ddp", "strategy.replica_groups=3", "strategy.replica_group=2"] + FT)
    dims = ParallelDims.from_config(cfg.strategy, 2)
    assert (dims.group_dp_size, dims.dp_size) == (2, 6)
    assert [dims.dp_coordinates(r) for r in (0, 1)] == [(4, 6), (5, 6)]
    plain = ParallelDims.from_config(compose_config(["strategy=ddp", "strategy.replica_groups=3"]).strategy, 2)
    assert plain.dp_size == 2  # replica_groups means nothing without fault_tolerance=torchft


def test_each_group_runs_in_a_folder_of_its_own():
    cfg = compose_config(["strategy=ddp", "strategy.replica_groups=2", "strategy.replica_group=1"] + FT)
    assert replica_groups.group_run_dir(cfg, "/runs/x") == "/runs/x/replica_group_1"
    assert replica_groups.group_run_dir(compose_config(["strategy=ddp"]), "/runs/x") == "/runs/x"


@pytest.mark.parametrize("overrides,launcher", [
    (["strategy=ddp", "strategy.fault_tolerance=torchft", "strategy.replica_groups=2"], "torchft 3"),
    (["strategy=hsdp", "strategy.fault_tolerance=torchft"], "torchft 3"),
    (["strategy=ddp", "strategy.fault_tolerance=torchft", "strategy.replica_groups=2", "strategy.replica_group=1"],
     "torchrun 3"),  # one group of a job whose lighthouse runs elsewhere
    (["strategy=ddp"], "torchrun 3"),
])
def test_launch_sh_starts_every_group_with_a_lighthouse_unless_one_group_is_named(overrides, launcher):
    assert launch_plan.plan_for(overrides) == launcher


def _problems(overrides, world_size=2):
    cfg = compose_config(overrides)
    return compat.strategy_problems(strategy_class(cfg.strategy.name), cfg, world_size)


@pytest.mark.parametrize("overrides,expected", [
    (["strategy=fsdp_tp", "strategy.tp=2", "strategy.fault_tolerance=torchft"],
     "strategy.fault_tolerance=torchft is not available with strategy=fsdp_tp and tensor or pipeline parallelism"),
    (["strategy=zero2", "strategy.fault_tolerance=torchft"],
     "strategy.fault_tolerance=torchft is not available with strategy=zero2"),
    (["strategy=ddp", "strategy.fault_tolerance=torchft", "strategy.replica_groups=2"],
     "strategy.replica_group=-1 must name this job's group, 0..1"),
    (["strategy=ddp", "strategy.fault_tolerance=torchft", "strategy.min_replica_groups=3"],
     "strategy.min_replica_groups=3 exceeds strategy.replica_groups=1"),
    (["strategy=ddp", "strategy.fault_tolerance=torchft", "strategy.lighthouse=nohost"],
     "strategy.lighthouse='nohost' is not an address"),
])
def test_torchft_configs_that_cannot_run_are_refused_by_key(overrides, expected, monkeypatch):
    monkeypatch.setenv(replica_groups.LIGHTHOUSE_ENV, "http://127.0.0.1:29510")
    problems = _problems(overrides)
    assert any(expected in p for p in problems), problems


def test_a_lighthouse_is_required(monkeypatch):
    monkeypatch.delenv(replica_groups.LIGHTHOUSE_ENV, raising=False)
    problems = _problems(["strategy=ddp", "strategy.fault_tolerance=torchft"])
    assert any("needs a lighthouse: set strategy.lighthouse" in p for p in problems), problems


def test_an_unreachable_lighthouse_is_an_error_at_once():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = compose_config(["strategy=ddp", "strategy.fault_tolerance=torchft",
                          f"strategy.lighthouse=http://127.0.0.1:{port}"])
    t0 = time.perf_counter()
    with pytest.raises(TesseraError, match=rf"lighthouse at http://127.0.0.1:{port} \(strategy.lighthouse\) "
                                           r"cannot be reached"):
        compat.preflight(cfg)
    assert time.perf_counter() - t0 < 5
