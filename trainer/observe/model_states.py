"""What each strategy's rank holds, in bytes per memory-report category (trainer/observe/memory.py's
CATEGORIES), read from the strategy's public surface and the libraries' public APIs: one function per strategy
class, mapped in STATE_BYTES. Called only for the memory report (logging.memory_report=true)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from trainer.parallel import fsdp as F2
from trainer.strategies.ddp import DDPStrategy
from trainer.strategies.deepspeed import DeepSpeedStrategy
from trainer.strategies.single import SingleStrategy
from trainer.strategies.torch_native import TorchNativeStrategy

CATEGORIES = ("params", "master_params", "optimizer", "grads", "gathered")


class StateBytes:
    """Bytes per memory-report category, each tensor counted once by its own bytes (numel x element size; a
    DTensor by its local shard): views of one buffer count what they cover, a buffer's unused rest is not seen."""

    def __init__(self):
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.seen = set()

    def add(self, category: str, tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta" or tensor.numel() == 0:
            return
        key = (tensor.device, tensor.data_ptr(), tensor.numel(), tensor.dtype)
        if key not in self.seen:
            self.seen.add(key)
            self.bytes[category] += tensor.numel() * tensor.element_size()

    def add_optimizer_state(self, optimizer) -> None:
        """The tensors in a torch optimizer's public `state` (AdamW: exp_avg, exp_avg_sq, step)."""
        for state in (optimizer.state.values() if optimizer is not None else ()):
            for value in state.values():
                self.add("optimizer", value)


def replica_bytes(strategy) -> dict:
    """The model's parameters and their `.grad` (a DTensor counts its local shard), the tensors in the optimizer's
    `state`: single, ddp, and tensor / pipeline parallelism without FSDP."""
    count = StateBytes()
    params = list(strategy.unwrapped().parameters())
    for p in params:
        count.add("params", p)
    count.add_optimizer_state(strategy.optimizer)
    for p in params:
        count.add("grads", p.grad)
    return count.bytes


def native_bytes(strategy) -> dict:
    """FSDP2's sharded parameters, gradients and optimizer state (trainer/parallel/fsdp.py counts them)."""
    if not strategy.fsdp_enabled:
        return replica_bytes(strategy)
    count = StateBytes()
    F2.count_fsdp_states(strategy, count)
    return count.bytes


def zero_bytes(strategy) -> dict:
    """params: the bit16 parameters (ZeRO-1/2: every one, whole; ZeRO-3: this rank's partitions, sized by
    deepspeed.utils.safe_get_local_fp32_param, plus any parameter whole or gathered now); master_params: the fp32
    partitions (ZeRO-1/2: in the client optimizer's param groups; ZeRO-3: safe_get_local_fp32_param);
    optimizer: the client optimizer's `state`;
    grads: `.grad` of the bit16 parameters (where DeepSpeed leaves them) and of the fp32 partitions (set in the
    step), and ZeRO-3's bit16 gradient partitions (deepspeed.utils.safe_get_local_grad). Not reachable through a
    public API, so not counted: ZeRO-1/2's bit16 gradient partitions and the reduction buckets."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_grad  # DeepSpeed runs only

    count = StateBytes()
    params = list(strategy.unwrapped().parameters())
    stage3 = strategy.cfg.strategy.zero_stage == 3
    # ZeRO-3 puts its fp32 partitions in the param groups only while it steps them.
    masters = [t for group in strategy.optimizer.param_groups for t in group["params"]]
    for p in params:
        count.add("params", p)  # ZeRO-3: empty unless whole (persistent) or gathered now
        if stage3 and p.requires_grad:
            master = safe_get_local_fp32_param(p)
            count.bytes["params"] += master.numel() * p.element_size()  # the bit16 partition, same elements
            count.bytes["master_params"] += master.numel() * master.element_size()
        elif stage3 and hasattr(p, "ds_tensor"):  # frozen (peft=lora's base): its partition, no master copy
            count.bytes["params"] += p.ds_tensor.numel() * p.ds_tensor.element_size()
    if not stage3:
        for t in masters:
            count.add("master_params", t)
    count.add_optimizer_state(strategy.optimizer)
    for t in params + masters:
        count.add("grads", t.grad)
    if stage3 and strategy.cfg.strategy.offload_optimizer == "none":  # offloaded: the fp32 .grad above
        for p in params:
            if p.requires_grad:  # kept in the gradient-accumulation dtype, the parameter's (returned as fp32)
                count.bytes["grads"] += safe_get_local_grad(p).numel() * p.element_size()
    return count.bytes


STATE_BYTES = {SingleStrategy: replica_bytes, DDPStrategy: replica_bytes, DeepSpeedStrategy: zero_bytes,
               TorchNativeStrategy: native_bytes}


def state_bytes(strategy) -> dict:
    """Bytes this rank holds now per category."""
    return STATE_BYTES[type(strategy)](strategy)


def built_parameter_bytes(model) -> int:
    """Bytes of the parameters this rank holds right after model construction (a sharded build: its part). ZeRO-3
    builds partitioned: each parameter's bit16 partition, read from `ds_tensor` (DeepSpeed offers no public accessor
    before the engine exists)."""
    count = StateBytes()
    for p in model.parameters():
        count.add("params", p)
        count.add("params", getattr(p, "ds_tensor", None))
    return count.bytes["params"]


def native_layout(strategy) -> dict:
    """FSDP2's shard group and unit sizes, which explain the figures."""
    if not strategy.fsdp_enabled:
        return {}
    layout = F2.fsdp_layout(strategy, strategy.dp_mesh.size(strategy.dp_mesh.ndim - 1))  # the shard dimension's size
    return {} if layout is None else {"fsdp": layout}


LAYOUTS = {TorchNativeStrategy: native_layout}  # the strategies whose memory.json explains its figures


def memory_layout(strategy) -> dict:
    """Extra top-level entries for memory.json that explain the figures."""
    layout = LAYOUTS.get(type(strategy))
    return layout(strategy) if layout is not None else {}
