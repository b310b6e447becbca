"""Data parallelism with DistributedDataParallel: a full replica per rank, gradients all-reduced.

Gradients are *summed* across ranks: each rank's loss is already its share of the global token-normalized loss,
so the sum is exactly the global batch's gradient, whatever the number of ranks. torch's communication hooks
average (they divide by the world size), so a bucket is multiplied by the world size before one runs.

`strategy.comm_hook` compresses what the reduction sends with torch's DDP hooks: `bf16` / `fp16` (half the
bytes; the sum is computed in that dtype) or `powersgd` (rank-`strategy.powersgd_rank` factors P and Q of each
large matrix with error feedback, after `strategy.powersgd_warmup_steps` uncompressed steps). PowerSGD's
per-rank state (error feedback, the warm-started Q, its step counter) is in the checkpoint, per parameter, so a
resumed run continues it exactly even though DDP lays out its buckets differently after a restart.

With `strategy.fault_tolerance=torchft` this process group is one of several replica groups (replica_groups.py):
after DDP's reduction inside the group each rank's gradient is summed with the other live groups', and a group
that (re)starts copies the state of a live one.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.strategies.capabilities import Capabilities
from trainer.strategies.base import Strategy
from trainer.parallel.sync import Worker

COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")


def _allreduce_sum_hook(group, bucket):
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def summing(hook, world_size: int):
    """A torch comm hook (which averages over the ranks) made to sum: the bucket is scaled by the world size."""
    def summed(state, bucket):
        bucket.buffer().mul_(world_size)
        return hook(state, bucket)

    return summed


class PowerSGD:
    """torch's PowerSGD hook, with its per-rank state saved and restored per parameter (`state_dict`)."""

    MIN_COMPRESSION_RATE = 2  # torch's default: a matrix is compressed when (m + n) r * 2 < m n

    def __init__(self, group, names: dict, rank: int, warmup_steps: int, seed: int):
        self.names = names  # id(parameter) -> name
        self.state = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=warmup_steps,
            min_compression_rate=self.MIN_COMPRESSION_RATE, use_error_feedback=True, warm_start=True,
            random_seed=seed)
        self.layout = {}  # bucket index -> [(name, shape)] of its gradients, in the bucket's order
        self.pending = None  # per-parameter state waiting for the bucket that now holds each parameter

    def hook(self, state, bucket):
        index = bucket.index()
        layout = [(self.names[id(p)], tuple(g.shape)) for p, g in zip(bucket.parameters(), bucket.gradients())]
        if self.layout.get(index, layout) != layout:
            # DDP rebuilt its buckets (it does after the first step of every process): move the state over.
            self.pending = {**(self.pending or {}), **self._per_parameter()}
            self.layout = {}
        self.layout[index] = layout
        if self.pending and self.state.iter >= self.state.start_powerSGD_iter:
            self._restore_bucket(index, layout, bucket.buffer())
        return powerSGD_hook.powerSGD_hook(state, bucket)

    # ---- per-parameter state: independent of how the buckets are laid out -----------------------------------
    def _q_slices(self, layout):
        """([(name, offset, length)] of each compressed matrix's Q in its bucket's flat Q memory, the length of
        the bucket's P memory): torch's hook lays the Qs out by shape, in the order each shape first appears."""
        r_max = self.state.matrix_approximation_rank
        by_shape = OrderedDict()
        for name, shape in layout:
            if len(shape) < 2:
                continue
            rows, cols = shape[0], int(torch.Size(shape[1:]).numel())
            r = min(rows, cols, r_max)
            if (rows + cols) * r * self.MIN_COMPRESSION_RATE < rows * cols:
                by_shape.setdefault((rows, cols), []).append((name, cols * r, rows * r))
        out, offset, p_total = [], 0, 0
        for entries in by_shape.values():
            for name, length, p_length in entries:
                out.append((name, offset, length))
                offset += length
                p_total += p_length
        return out, p_total

    def _per_parameter(self) -> dict:
        pieces = {}
        for index, layout in self.layout.items():
            error = self.state.error_dict.get(index)
            if error is not None:
                offset = 0
                for name, shape in layout:
                    n = int(torch.Size(shape).numel())
                    pieces[f"error.{name}"] = error[offset:offset + n].clone()
                    offset += n
            q = self.state.q_memory_dict.get(index)
            if q is not None:
                for name, offset, length in self._q_slices(layout)[0]:
                    pieces[f"q.{name}"] = q[offset:offset + length].clone()
        return pieces

    def _restore_bucket(self, index, layout, buffer) -> None:
        errors = [self.pending.pop(f"error.{name}", None) for name, _ in layout]
        if all(e is not None for e in errors):
            self.state.error_dict[index] = torch.cat([e.reshape(-1) for e in errors]).to(buffer)
        slices, p_total = self._q_slices(layout)
        qs = [self.pending.pop(f"q.{name}", None) for name, _, _ in slices]
        if slices and all(q is not None for q in qs):  # warm start: Q goes on from where it was
            self.state.q_memory_dict[index] = torch.cat(qs).to(buffer)
            self.state.p_memory_dict[index] = torch.empty(p_total, dtype=buffer.dtype, device=buffer.device)

    def state_dict(self) -> dict:
        return {"iter": torch.tensor(self.state.iter), **(self.pending or {}), **self._per_parameter()}

    def load_state_dict(self, state: dict) -> None:
        self.state.iter = int(state.pop("iter"))
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()
        self.layout = {}
        self.pending = dict(state)


class DDPStrategy(Strategy):
    name = "ddp"
    capabilities = Capabilities(degrees=frozenset({"dp_replicate"}), fault_tolerance=frozenset({"torchft"}),
                                comm_hooks=frozenset(COMM_HOOKS), periodic_sync=True, holds_whole_model=True)

    def setup(self, model, build_optimizer, initial_weights=None):
        self.prepare_blocks(model)
        self.load_initial_weights(model, initial_weights)
        model = model.to(self.device)
        s = self.cfg.strategy
        self.powersgd, self.ddp = None, None
        if self.independent_replicas:
            # Local SGD / DiLoCo: each rank is a worker with its own copy (trainer/parallel/sync.py synchronises)
            self.model = model
        else:
            bucket_cap_mb = s.bucket_cap_mb
            if s.comm_hook == "powersgd" and dist.get_backend(self.dp_group()) == "gloo":
                # gloo runs each bucket's second all-reduce (Q) from a callback of its first (P), so two buckets'
                # collectives can reach the ranks in different orders (measured: gloo aborts with a size
                # mismatch). One bucket keeps the order; on the CPU there is no backward to overlap with anyway.
                model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
                bucket_cap_mb = max(bucket_cap_mb, model_mib + 1)
            self.ddp = DDP(model, device_ids=[self.device] if self.device.type == "cuda" else None,
                           bucket_cap_mb=bucket_cap_mb, find_unused_parameters=s.find_unused_parameters,
                           gradient_as_bucket_view=s.gradient_as_bucket_view)
            self._register_comm_hook(model)
            self.model = self.ddp
        self.optimizer = build_optimizer(model.named_parameters())
        return self.model, self.optimizer

    def _register_comm_hook(self, model) -> None:
        s, group = self.cfg.strategy, self.dp_group()
        world = dist.get_world_size(group)
        if s.comm_hook == "none":
            self.ddp.register_comm_hook(group, _allreduce_sum_hook)
        elif s.comm_hook in ("bf16", "fp16"):
            hook = default_hooks.bf16_compress_hook if s.comm_hook == "bf16" else default_hooks.fp16_compress_hook
            self.ddp.register_comm_hook(group, summing(hook, world))
        else:
            names = {id(p): n for n, p in model.named_parameters()}
            self.powersgd = PowerSGD(group, names, s.powersgd_rank, s.powersgd_warmup_steps, self.cfg.train.seed)
            self.ddp.register_comm_hook(self.powersgd.state, summing(self.powersgd.hook, world))

    def local_worker(self):
        if not self.independent_replicas:
            return None
        group = self.dp_group()
        # what trains (peft=lora: the adapters; the frozen base is the same on every worker)
        return Worker({n: p for n, p in self.model.named_parameters() if p.requires_grad}, group,
                      dist.get_world_size(group))

    def local_state(self) -> dict:
        if self.powersgd is not None:
            return {"powersgd": self.powersgd.state_dict()}
        if self.independent_replicas:  # this worker's weights and optimizer state differ from the others'
            return {"weights": {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad},
                    "optimizer": self.optimizer.state_dict()}
        return {}

    def load_local_state(self, state) -> str:
        if self.powersgd is not None:
            if state is None or "powersgd" not in state:
                return "PowerSGD's error feedback starts empty (the checkpoint has none for this rank)"
            self.powersgd.load_state_dict(dict(state["powersgd"]))
        elif self.independent_replicas and state is not None and "weights" in state:
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    if p.requires_grad:
                        p.copy_(state["weights"][n])
            self.optimizer.load_state_dict(state["optimizer"])
        return ""

    def accumulation_context(self, is_last_micro_batch: bool):
        if self.ddp is None or is_last_micro_batch:
            return super().accumulation_context(True)
        return self.ddp.no_sync()

    def unwrapped(self):
        return self.ddp.module if self.ddp is not None else self.model

    def close(self) -> None:
        super().close()
        self.ddp = None
