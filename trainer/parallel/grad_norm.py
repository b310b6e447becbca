"""The global gradient norm over shards, stages and replicas (fp64 sums, DTensor parts weighted by their
replicas), and clipping to it."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def grad_square_sum(grads) -> torch.Tensor:
    """Sum of the squared entries of this rank's gradient tensors (their local parts, for DTensors), accumulated
    in fp64: an fp32 sum drifts by ~1e-4 relative over a large embedding, so strategies would disagree on the norm
    and on clipping. A DTensor's part counts 1/(its replicas): summed over every rank (world_square_sum), each
    entry of the whole gradient then counts once, whatever the mesh."""
    total = None
    groups = {}
    for g in grads:
        replicas = 1
        if isinstance(g, DTensor):
            for dim, placement in enumerate(g.placements):
                if placement.is_replicate():
                    replicas *= g.device_mesh.size(dim)
            g = g.to_local()
        if g.numel():
            groups.setdefault(replicas, []).append(g)
    # torch._foreach_norm: per-tensor norms with an fp64 result in one kernel; no public function returns those.
    for replicas, local in groups.items():  # stays on the gradients' device: no host sync in the step
        sq = torch.stack(torch._foreach_norm(local, 2.0, dtype=torch.float64)).pow(2).sum() / replicas
        total = sq if total is None else total + sq.to(total.device)
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def world_square_sum(grads, device: torch.device, group=None) -> torch.Tensor:
    """grad_square_sum over every rank (one all-reduce): the squared norm of the whole model's gradient when
    each rank holds a part of it (shards, stages), each DTensor part weighted by 1/(its replicas). (An all-reduce
    over the mesh dimensions the gradient is split over would be fewer bytes, but FSDP2's 2-D (shard x tp) mesh
    gives groups that miss ranks on gloo: measured, the norm came out ~30% low.) `group`: only over its ranks (a
    local-SGD worker's own gradient)."""
    sq = grad_square_sum(grads).to(device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return sq


def clip_to_norm(params, norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale the gradients of `params` so that their global norm `norm` is at most `max_norm` (> 0)."""
    if max_norm > 0 and params:
        # by mesh: DTensor's foreach kernels take one mesh (expert-parallel experts live on their own)
        by_mesh = {}
        for p in params:
            by_mesh.setdefault(id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None, []).append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm.float())
    return norm
