"""FSDP2 (`fully_shard`): `fsdp` shards over every data-parallel rank, `hsdp` replicates across
`strategy.dp_replicate` groups and shards within each group of `strategy.dp_shard` ranks.

Each decoder block and then the root are wrapped. The model is built with its parameters on the meta device
(buffers real), sharded, materialized shard by shard, and filled: seeded preset weights one block at a time,
or pretrained weights of which each rank reads only the rows it owns. No rank ever holds the whole model.

Numbers: gradients are *summed* over the data-parallel ranks (FSDP's default divides by the data-parallel
size, and on gloo, pytorch/pytorch#162338, may not): each rank's loss is already its share of the global
token-normalized loss, so the sum is the global batch's gradient. Sum-only reductions are forced, so the
result is the same on gloo and NCCL.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from models.init import retie, shared_parameters
from models.weights import is_checkpoint
from tessera.errors import ModelError
from trainer.run.precision import DTYPES, autocast_dtype


def fsdp_config_problems(cfg) -> List[str]:
    """The FSDP knobs (strategy.param_dtype / reduce_dtype / cpu_offload) and the DeepSpeed ones FSDP rejects."""
    problems = []
    s = cfg.strategy
    for key, allowed in (("param_dtype", DTYPES), ("reduce_dtype", ("fp32", "bf16"))):
        value = getattr(s, key)
        if value is not None and value not in allowed:
            problems.append(f"strategy.{key}={value!r} is not one of null, {', '.join(allowed)}")
    for key in ("offload_optimizer", "offload_param"):
        if getattr(s, key) != "none":
            problems.append(f"strategy.{key}={getattr(s, key)} is a DeepSpeed option; FSDP offloads "
                            f"parameters, gradients and optimizer state together: set strategy.cpu_offload=true "
                            f"and strategy.{key}=none")
    if s.deepspeed_config:
        problems.append(f"strategy.deepspeed_config is a DeepSpeed option; strategy={s.name} does not read it")
    if s.cpu_offload and cfg.precision.name == "fp16":
        problems.append("strategy.cpu_offload=true with precision=fp16 is not supported (the loss scaler's "
                        "unscale runs on the accelerator); use precision=bf16")
    if s.param_dtype == "fp16" and cfg.precision.name != "fp16":
        problems.append(f"strategy.param_dtype=fp16 needs loss scaling: use precision=fp16 (got "
                        f"precision={cfg.precision.name}) or strategy.param_dtype=bf16")
    return problems


def fsdp_dtypes(cfg):
    """(param_dtype, reduce_dtype) of FSDP's mixed-precision policy: the compute dtype follows precision= unless
    strategy.param_dtype says otherwise; gradients are reduced in fp32 unless strategy.reduce_dtype=bf16."""
    s = cfg.strategy
    param = DTYPES[s.param_dtype] if s.param_dtype else autocast_dtype(cfg.precision.name)
    return param, DTYPES[s.reduce_dtype or "fp32"]


def apply_fsdp(blocks, root, mesh, param_dtype, reduce_dtype, reshard_after_forward: bool, cpu_offload: bool,
               pin_memory: bool, inner=()) -> None:
    """fully_shard each block, then the root, over `mesh` (1-D: shard; 2-D replicate x shard: hsdp), with the
    mixed-precision and offload policies; gradients summed (see the module docstring). `inner`: (module, mesh)
    pairs sharded first over a mesh of their own (expert-parallel experts: over the ranks holding the same
    experts)."""
    options = dict(
        mesh=mesh, reshard_after_forward=reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy(pin_memory=pin_memory) if cpu_offload else OffloadPolicy())
    for module, module_mesh in inner:
        fully_shard(module, **dict(options, mesh=module_mesh))
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(root, **options)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)


def materialize(model, device: torch.device, cpu_offload: bool) -> None:
    """Allocate this rank's part of the meta parameters (uninitialized), keeping the buffers built on the host;
    with CPU offload the parameters stay on the host and the buffers go to the device. Parameters that modules
    share (tied embeddings) stay shared: `to_empty` gives each module a new parameter object where the
    parameter is a DTensor, so the ties are recorded first and made again."""
    ties = shared_parameters(model)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device="cpu" if cpu_offload else device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    if cpu_offload:
        for module in model.modules():  # buffers are not FSDP's: they compute on the device
            for key, b in list(module.named_buffers(recurse=False)):
                setattr(module, key, b.to(device))  # replaces the registered buffer, persistence kept
    retie(ties)


@torch.no_grad()
def load_full_tensors(targets: dict, initial_weights) -> None:
    """Write full tensors into `targets` ({name: parameter or buffer}, DTensor shards or plain), each rank only
    its part: a pretrained checkpoint (models.weights.PretrainedWeights: each rank reads its block of each
    tensor), or seeded preset units (an iterable of {name: full tensor}; names a rank does not hold are skipped:
    pipeline stages hold only some of the model)."""
    if initial_weights is None:
        return
    if is_checkpoint(initial_weights):
        for name, target in targets.items():
            if initial_weights.key(name) is None:
                continue  # a buffer the checkpoint does not hold: as built
            _write(target, lambda index, n=name: initial_weights.read(n, index))
        return
    for values in initial_weights:
        for name, value in values.items():
            if name in targets:
                _write(targets[name], lambda index, v=value: v[index] if index is not None else v)


def missing_pretrained(initial_weights, named_parameters) -> None:
    """A pretrained checkpoint must hold every parameter the model has (a buffer may be missing)."""
    missing = initial_weights.missing(n for n, _ in named_parameters)
    if missing:
        raise ModelError(f"model.name_or_path: the checkpoint in {initial_weights.folder} lacks "
                         f"{len(missing)} of the model's parameters ({', '.join(missing[:4])} ...)")


def _write(target: torch.Tensor, read) -> None:
    """Copy this rank's part of a full tensor into `target` (a DTensor shard, on any mesh and placements, or a
    plain tensor); `read(index)` returns the full tensor's block at a tuple of slices (None: all of it)."""
    # torch has no public function for a shard's offset in the full tensor (DTensor uses this one itself).

    if not isinstance(target, DTensor):
        target.copy_(read(None))
        return
    local = target.to_local()
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if local.numel() == 0 or 0 in shape:
        return
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape)) if target.dim() else None
    local.copy_(read(index).reshape(local.shape))


class ScalarFoundInfScaler(ShardedGradScaler):
    """ShardedGradScaler with its found-inf flags as torch.amp.GradScaler keeps them: 0-d and 0 or 1. It makes
    them shape (1,), and torch's fused optimizers subtract the flag from their 0-d step counters in place, which
    fails ("output with shape [] doesn't match the broadcast shape [1]"); and it sums them over the ranks, where a
    fused kernel skips its update only for a flag of exactly 1: with 2 ranks overflowing it stepped on the
    non-finite gradients (every weight NaN) and counted the step back twice."""

    def unscale_(self, optimizer) -> None:
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]  # GradScaler keeps its flags here only (no accessor)
        state["found_inf_per_device"] = {d: f.clamp(max=1.0).reshape(())
                                         for d, f in state["found_inf_per_device"].items()}


# ---- memory report (logging.memory_report): FSDP2 seen through its public module API --------------------------
def fsdp_trees(strategy) -> list:
    """[(root, [FSDP2 modules in its tree, root first])] for the strategy's module trees that contain FSDP2
    (`fully_shard`) modules: the pipeline stage modules a strategy keeps apart from its model (`stage_modules`;
    FSDP's root there is the stage module, which the model's tree does not contain), then the model. Each FSDP
    module once, in the first tree that holds it."""
    roots = [*(getattr(strategy, "stage_modules", None) or {}).values(), strategy.unwrapped()]
    trees, seen = [], set()
    for root in roots:
        found = []
        for m in root.modules() if isinstance(root, torch.nn.Module) else []:
            if id(m) not in seen and isinstance(m, FSDPModule):
                seen.add(id(m))
                found.append(m)
        if found:
            trees.append((root, found))
    return trees


def reshard_all(strategy) -> None:
    """Register the sharded parameters again on every FSDP2 module of the strategy. A forward without a backward
    (evaluation) leaves them gathered under reshard_after_forward=false, where only the backward reshards: the
    modules would then hold whole parameters that the optimizer and the checkpoint do not know."""
    for _, modules in fsdp_trees(strategy):
        for module in modules:
            module.reshard()


def count_fsdp_states(strategy, count) -> None:
    """FSDP2: the optimizer holds the sharded parameters (DTensors; their local shards are this rank's fp32
    parameters, also the master copy: FSDP casts what it all-gathers and keeps no other). Between a module's
    all-gather and its reshard FSDP registers the all-gathered (unsharded) parameters on the module instead:
    what the module's parameters are then, and not the optimizer's, is `gathered` (bf16 under precision=bf16).
    Gradients: `.grad` of both (sharded: views into the reduce-scatter output; unsharded: in backward)."""
    # frozen parameters (peft=lora's base) are sharded too, outside the optimizer: the strategy keeps them
    sharded = [p for group in strategy.optimizer.param_groups for p in group["params"]] + \
        list(getattr(strategy, "frozen_shards", []))
    managed = {id(p) for p in sharded}
    modules = [root for root, _ in fsdp_trees(strategy)] + [strategy.unwrapped()]
    gathered = {id(p): p for m in modules for p in m.parameters() if id(p) not in managed}
    for p in sharded:
        count.add("params", p)
    for p in gathered.values():
        count.add("gathered", p)
    count.add_optimizer_state(strategy.optimizer)
    for p in sharded + list(gathered.values()):
        count.add("grads", p.grad)


def _first_grad_tensor(output):
    """The first tensor in a module's output (tensor, tuple / list, dict / ModelOutput) that requires grad."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for v in values:
        t = _first_grad_tensor(v)
        if t is not None:
            return t
    return None


def _watch_fsdp(snap, root, modules: list) -> list:
    """FSDP2: the gathered (unsharded) parameters exist only in forward and backward. During the first
    micro-batch: `forward` at every FSDP module's forward, after FSDP's own pre-forward hook gathered its
    parameters (and before resharding: reshard_after_forward=true frees a block's after its forward, false keeps
    every block's until its backward); `backward` when the gradient reaches the module's output, after FSDP's
    pre-backward hook (registered on the same output earlier, so it runs first) gathered the parameters again and
    prefetched the next block's (still in that block's flat all-gather output, counted as buffers, until its own
    pre-backward copies it out); the gradient shards of the blocks behind it exist by then, and the root's
    unsharded gradients (it reduce-scatters them only at the end of backward). Not seen: a block's unsharded
    gradients between its backward and their reduce-scatter."""
    forwards = [0]

    def count(module, args):
        forwards[0] += 1

    def pre(module, args):
        if forwards[0] == 1:
            snap("forward")

    def post(module, args, output):
        if forwards[0] != 1 or not torch.is_grad_enabled():
            return
        t = _first_grad_tensor(output)
        if t is not None:
            t.register_hook(lambda grad: snap("backward"))  # returns None: the gradient is unchanged

    handles = [root.register_forward_pre_hook(count, prepend=True)]  # counts the root's forwards (micro-batches)
    for m in modules:  # appended: they run after FSDP's pre-forward (prepended) and post-forward hooks
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    return [h.remove for h in handles]


def fsdp_layout(strategy, shard_size: int) -> Optional[dict]:
    """FSDP2 only: the shard group's size and each FSDP module's parameter count (full sizes; the root's first):
    what the gathered parameters of a module cost. A module's own parameters are those not under a nested FSDP
    module."""
    units = []
    for _, modules in fsdp_trees(strategy):
        for m in modules:
            nested = {id(p) for sub in m.modules() if sub is not m and isinstance(sub, FSDPModule)
                      for p in sub.parameters()}
            units.append(sum(p.numel() for p in m.parameters() if id(p) not in nested))  # DTensor: global numel
    return {"shard_size": shard_size, "unit_params": units} if units else None
