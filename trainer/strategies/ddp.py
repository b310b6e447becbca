"""Data parallelism with DistributedDataParallel: a full replica per rank, gradients all-reduced.

Gradients are *summed* across ranks (a comm hook replaces DDP's average): each rank's loss is already its
share of the global token-normalized loss, so the sum is exactly the global batch's gradient, whatever the
number of ranks.

With `strategy.fault_tolerance=torchft` this process group is one of several replica groups (replica_groups.py):
after DDP's reduction inside the group each rank's gradient is summed with the other live groups', and a group
that (re)starts copies the state of a live one.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.strategies.base import Strategy


def _allreduce_sum_hook(group, bucket):
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class DDPStrategy(Strategy):
    name = "ddp"
    degrees = frozenset({"dp_replicate"})
    fault_tolerance = frozenset({"torchft"})

    def setup(self, model, build_optimizer, initial_weights=None):
        self.prepare_blocks(model)
        self.load_initial_weights(model, initial_weights)
        model = model.to(self.device)
        s = self.cfg.strategy
        self.ddp = DDP(model, device_ids=[self.device] if self.device.type == "cuda" else None,
                       bucket_cap_mb=s.bucket_cap_mb, find_unused_parameters=s.find_unused_parameters,
                       gradient_as_bucket_view=s.gradient_as_bucket_view)
        self.ddp.register_comm_hook(self.dp_group(), _allreduce_sum_hook)
        self.model = self.ddp
        self.optimizer = build_optimizer(model.named_parameters())
        self.attach_replica_groups()
        return self.model, self.optimizer

    def accumulation_context(self, is_last_micro_batch: bool):
        return super().accumulation_context(True) if is_last_micro_batch else self.ddp.no_sync()

    def unwrapped(self):
        return self.ddp.module

    def close(self) -> None:
        super().close()
        self.ddp = None
