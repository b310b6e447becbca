"""The loss of a batch, as every strategy computes it: the sum of next-token cross-entropies over the target tokens
(normalised by the global batch's target count by the caller, never a mean of per-micro-batch means), per task
for mixtures, and the batch's copy onto the device."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.packing import PackedForward
from trainer.data.datasets import IGNORE

PACKED_FORWARD = PackedForward()  # one per process: the first packed batch checks the model


def token_loss_sum(model, batch: dict, precision, tasks=None, router=None, objective=None) -> torch.Tensor:
    """Sum of next-token cross-entropies over the micro-batch's target tokens (fp32), or the `objective`'s loss sum
    (trainer/objectives/objective.py). With `tasks` (TaskLosses) and rows that carry their task (data.kind=mixture),
    each row's sum is also added to its task's. `router`: the model's RouterBalance, whose forward arguments it takes
    (no load-balancing term)."""
    if objective is not None:
        batch = objective.prepare(batch)
    return _loss_sum(forward_logits(model, batch, precision, router), batch, tasks, objective)


def forward_logits(model, batch: dict, precision, router=None) -> torch.Tensor:
    """The logits of the batch's forward, as every loss takes them (under the precision's autocast; a mixture of
    experts asked for no router logits)."""
    with precision.autocast():
        return _forward(model, batch, router.forward_kwargs if router is not None else {}).logits


def micro_batch_losses(model, batch: dict, precision, tasks=None, router=None, cp=None, objective=None):
    """(the loss sum as token_loss_sum, the router's load-balancing term or None): with `router` (RouterBalance, its
    coef > 0) its term from the routers' logits (`cp`: the ContextParallel whose ranks hold the other parts of the
    sequences)."""
    if router is None or router.coef == 0:
        return token_loss_sum(model, batch, precision, tasks, router, objective), None
    if objective is not None:
        batch = objective.prepare(batch)
    with precision.autocast(), router.capturing() as router_logits:
        logits = _forward(model, batch, router.forward_kwargs).logits
    return _loss_sum(logits, batch, tasks, objective), router.term(router_logits, cp)


def _loss_sum(logits, batch: dict, tasks, objective) -> torch.Tensor:
    if objective is None:
        return cross_entropy_sum(logits, batch["labels"], tasks, batch.get("task"))
    return objective.loss_sum(logits, batch, tasks)


def _forward(model, batch: dict, extra: dict):
    if "position_ids" in batch:  # data.packing=documents: attention stays inside each packed document
        return PACKED_FORWARD(model, batch["input_ids"], batch["position_ids"], **extra)
    if "shard_position_ids" in batch:  # strategy.cp: a shard of each sequence (documents kept apart there)
        return model(input_ids=batch["input_ids"], position_ids=batch["shard_position_ids"], use_cache=False,
                     **extra)
    return model(input_ids=batch["input_ids"], use_cache=False, **extra)


def cross_entropy_sum(logits, labels, tasks, task) -> torch.Tensor:
    if tasks is None or task is None:
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                reduction="none").view(labels.shape)
    tasks.add(per_token.detach().sum(1), (labels != IGNORE).sum(1), task)
    return per_token.sum()


class TaskLosses:
    """Per-task token-loss sums and target-token counts of this rank's rows (data.kind=mixture), fp64."""

    def __init__(self, num_tasks: int, device: torch.device):
        self.sums = torch.zeros(num_tasks, 2, dtype=torch.float64, device=device)

    def add(self, row_losses: torch.Tensor, row_tokens: torch.Tensor, task: torch.Tensor) -> None:
        self.sums.index_add_(0, task.to(self.sums.device), torch.stack([row_losses.double(), row_tokens.double()], 1))

    def reset(self) -> None:
        self.sums.zero_()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch tensor onto the device without waiting for it: CUDA drains the stream before a copy from
    pageable memory, so the host could not queue the next micro-batch while the device computes; a copy from
    page-locked memory is queued like a kernel."""
    if device.type != "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
