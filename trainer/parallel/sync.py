"""Less frequent synchronisation of data-parallel workers: local SGD and DiLoCo (`sync=` config group).

A worker is one data-parallel replica: a DDP rank, or an HSDP replica group (FSDP2 shards the worker's model
inside the group, every step; the workers synchronise their shards, rank i of each group with rank i of the
others, every H steps). Between synchronisations each worker runs its own optimizer
on its own share of every global batch and reduces nothing. Each worker's loss is its token-loss sum divided by
the global batch's target tokens, times the number of workers: averaging the workers' updates then weights every
token of the global batch equally, as one synchronous step does (with SGD and sync.every=1, local SGD is DDP).

Every `sync.every` (H) steps:
- local_sgd: the workers' weights are averaged (one all-reduce of the weights).
- diloco: each worker's change since the last synchronisation (the pseudo-gradient, anchor - weights) is
  averaged, an outer SGD with Nesterov momentum (sync.outer_lr, sync.outer_momentum) steps the anchor with it,
  and every worker continues from the new anchor. The inner optimizer's state stays local (DiLoCo).
- sync.overlap: the all-reduce of round k runs while the H steps of round k+1 compute; its result is applied at
  the end of round k+1, which keeps the progress the worker made since it sent (one round late, as streaming
  DiLoCo does). local_sgd with overlap is diloco with outer lr 1 and no momentum.

The bytes per step are those of the weights every H steps (fp32; with overlap the same, hidden behind compute).
The checkpoint keeps each worker's weights, its optimizer state, the anchor, the outer momentum and an in-flight
round (`local_state`), so a resumed run continues exactly; the shared "model" tensors of a checkpoint are worker
0's weights (right after a synchronisation: the synchronised model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist


@dataclass
class Worker:
    """A local-SGD / DiLoCo worker as a strategy lays it out (`Strategy.local_worker`): the tensors it trains on
    this rank (plain tensors: a DTensor gives its local shard), the group that synchronises them with the other
    workers' (None: one worker) and the number of workers."""

    params: Dict[str, torch.Tensor]
    group: object
    size: int


class EveryStep:
    """sync=every_step: the strategy reduces the gradients of every step; nothing happens around the loop."""

    grad_weight = 1.0

    def after_step(self, step: int) -> None:
        pass

    def local_state(self) -> dict:
        return {}

    def load_local_state(self, state) -> str:
        return ""


def synchronisation(cfg, strategy):
    """The run's synchronisation context (torchtitan's semi-sync pattern): PeriodicSync over the strategy's local
    worker when sync= is local_sgd or diloco, else EveryStep. The loop weighs the gradient with `grad_weight` and
    calls `after_step(step)` after every step it takes; the checkpoint keeps `local_state()` per rank."""
    worker = strategy.local_worker()
    return EveryStep() if worker is None else PeriodicSync(cfg, worker)


class PeriodicSync:
    def __init__(self, cfg, worker: Worker):
        self.cfg = cfg.sync
        self.mode = self.cfg.name
        self.every = self.cfg.every
        self.overlap = self.cfg.overlap
        self.group, self.workers = worker.group, worker.size
        self.params = worker.params  # name -> this worker's tensor
        self._start_from_worker_zero()
        self.anchor: Optional[Dict[str, torch.Tensor]] = None
        self.outer = None
        self.sent: Optional[Dict[str, torch.Tensor]] = None  # overlap: the weights when the round in flight left
        self.inflight = None  # overlap: (work or None, summed flat buffer) of the round in flight
        if self.overlap:
            self.sent = {n: p.detach().float().clone() for n, p in self.params.items()}
        if self.uses_anchor:
            self.anchor = {n: p.detach().clone().float() for n, p in self.params.items()}
            for t in self.anchor.values():
                t.requires_grad_(True)
            lr, momentum = (1.0, 0.0) if self.mode == "local_sgd" else (self.cfg.outer_lr, self.cfg.outer_momentum)
            self.outer = torch.optim.SGD(list(self.anchor.values()), lr=lr, momentum=momentum,
                                         nesterov=momentum > 0)

    @torch.no_grad()
    def _start_from_worker_zero(self) -> None:
        """Every worker starts from one model (worker 0's), as every_step's replicas do."""
        if self.workers > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            for t in self.params.values():
                dist.broadcast(t, src=src, group=self.group)

    @property
    def uses_anchor(self) -> bool:
        return self.mode == "diloco" or self.overlap

    @property
    def grad_weight(self) -> float:
        """A worker's gradient stands for all the workers' (its loss is its share's sum over the global batch's
        target tokens, times the number of workers)."""
        return float(self.workers)

    # ---- the boundary ------------------------------------------------------------------------------------
    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """After every step the loop takes (`step`: steps done, whether or not this worker's update was skipped,
        so all workers meet at the same boundaries): synchronise on every sync.every-th."""
        if step % self.every:
            return
        if not self.uses_anchor:
            flat = self._flat(self.params.values())
            self._all_reduce(flat)
            self._unflat(flat.div_(self.workers), self.params.values())
        elif not self.overlap:
            flat = self._flat(self.anchor[n].detach() - p.float() for n, p in self.params.items())
            self._all_reduce(flat)
            self._outer_step(flat.div_(self.workers))
            for n, p in self.params.items():
                p.copy_(self.anchor[n])
        else:
            self._overlapped_boundary()

    def _overlapped_boundary(self) -> None:
        # this round's pseudo-gradient: minus what this worker learned since the last boundary
        delta = self._flat(self.sent[n] - p.float() for n, p in self.params.items())
        if self.inflight is not None:  # the previous round lands: the anchor moves, the worker keeps its progress
            work, landed = self.inflight
            if work is not None:
                work.wait()
            self._outer_step(landed.div_(self.workers))
            for n, p in self.params.items():
                p.add_((self.anchor[n].detach() - self.sent[n]).to(p.dtype))
        self.sent = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.inflight = (self._all_reduce(delta, async_op=True), delta)

    def _outer_step(self, mean_delta: torch.Tensor) -> None:
        offset = 0
        for t in self.anchor.values():
            n = t.numel()
            t.grad = mean_delta[offset:offset + n].view_as(t).clone()
            offset += n
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)

    def _all_reduce(self, flat: torch.Tensor, async_op: bool = False):
        if self.workers > 1:
            return dist.all_reduce(flat, group=self.group, async_op=async_op)
        return None

    @staticmethod
    def _flat(tensors) -> torch.Tensor:
        return torch.cat([t.reshape(-1).float() for t in tensors])

    @staticmethod
    def _unflat(flat: torch.Tensor, tensors) -> None:
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n

    # ---- checkpoint: this worker's own state -----------------------------------------------------------------
    def local_state(self) -> dict:
        """What this rank's checkpoint file keeps for the synchronisation (beside the strategy's own: the worker's
        weights and optimizer state)."""
        return {"sync": self.state_dict()}

    def load_local_state(self, state) -> str:
        return self.load_state_dict(None if state is None else state.get("sync"))

    def state_dict(self) -> dict:
        state = {}
        if self.anchor is not None:
            state["anchor"] = {n: t.detach() for n, t in self.anchor.items()}
            momentum = {}
            for n, t in self.anchor.items():
                buf = self.outer.state.get(t, {}).get("momentum_buffer")
                if buf is not None:
                    momentum[n] = buf
            state["outer_momentum"] = momentum
        if self.inflight is not None:
            work, flat = self.inflight
            if work is not None:
                work.wait()
            self.inflight = (None, flat)  # landed; applied at the next boundary as before
            state["inflight"] = flat
        if self.sent is not None:
            state["sent"] = self.sent
        return state

    def load_state_dict(self, state: Optional[dict]) -> str:
        if state is None:
            for n, p in self.params.items():
                if self.anchor is not None:
                    self.anchor[n].data.copy_(p)
                if self.sent is not None:
                    self.sent[n].copy_(p)
            return (f"sync={self.mode}: no state of this worker in the checkpoint (another world size): every "
                    f"worker starts from the checkpoint's model; the outer momentum starts at zero")
        if self.anchor is not None:
            for n, t in self.anchor.items():
                t.data.copy_(state["anchor"][n])
            for n, buf in state.get("outer_momentum", {}).items():
                self.outer.state[self.anchor[n]]["momentum_buffer"] = buf.clone()
        if "inflight" in state:
            self.inflight = (None, state["inflight"].clone())
        if "sent" in state:
            self.sent = {n: t.clone() for n, t in state["sent"].items()}
        return ""


def sync_state_bytes(cfg, psi: float) -> tuple:
    """(master weights, optimizer state) bytes that sync= keeps beside a worker's `psi` parameters (a rank's
    share of them): DiLoCo's (or an overlapped round's) fp32 anchor, DiLoCo's outer momentum, an overlapped
    round's sent weights."""
    s = cfg.sync
    if not (s.name == "diloco" or (s.name == "local_sgd" and s.overlap)):
        return 0, 0
    optimizer = (4 * psi if s.name == "diloco" and s.outer_momentum > 0 else 0) + (4 * psi if s.overlap else 0)
    return 4 * psi, optimizer


def sync_problems(cfg, can_sync: bool, without_model_parallel: bool) -> List[str]:
    """Config problems of the sync group for a strategy (`can_sync`: whether it runs local SGD / DiLoCo in this
    layout; `without_model_parallel`: whether it would with strategy.tp=1 and strategy.pp=1)."""
    s = cfg.sync
    if s.name == "every_step":
        if s.overlap:
            return ["sync.overlap=true needs sync=local_sgd or sync=diloco"]
        return []
    problems = []
    if not can_sync:
        problems.append(f"sync={s.name} is not available with strategy={cfg.strategy.name}"
                        f"{' and tensor or pipeline parallelism' if without_model_parallel else ''}; use "
                        f"strategy=ddp (each rank a worker), strategy=hsdp (each replica group a worker, sharded "
                        f"inside) or sync=every_step")
    if cfg.strategy.fault_tolerance != "none":
        problems.append(f"sync={s.name} does not run with strategy.fault_tolerance={cfg.strategy.fault_tolerance} "
                        f"yet; use sync=every_step with replica groups")
    if cfg.strategy.comm_hook != "none":
        problems.append(f"strategy.comm_hook={cfg.strategy.comm_hook} compresses the per-step gradient reduction, "
                        f"which sync={s.name} does not run; set strategy.comm_hook=none")
    return problems
