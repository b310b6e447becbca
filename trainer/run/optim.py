"""Optimizers (AdamW, SGD) and learning-rate schedules (constant, linear, cosine; each with linear warmup)."""
from __future__ import annotations

import functools
import math

import torch

from tessera.errors import ConfigError


def param_groups(named_params, weight_decay: float):
    """Weight decay on matrices only: biases, norms' gains and 1-D parameters are not decayed."""
    decay, no_decay = [], []
    for _, p in named_params:
        if not p.requires_grad:
            continue
        shape = getattr(p, "ds_shape", p.shape)  # a ZeRO-3 partition is 1-D; its full shape says what it is
        (decay if len(shape) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")


# Optimizers whose fused kernel DTensor parameters (FSDP2, tensor and pipeline layouts) take: torch registers
# sharding rules for aten._fused_adam(w)_ but not for aten._fused_sgd_ (tests/unit/run/test_optim.py checks both).
DTENSOR_FUSED = frozenset({"adamw"})


@functools.lru_cache(maxsize=None)
def fused_kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's fused optimizer kernels take tensors of `dtype` on `device`: tried with one step of a fused
    AdamW on a one-element tensor (torch's own list of such devices is private; AdamW and SGD share it)."""
    if not dtype.is_floating_point:
        return False
    probe = torch.zeros(1, device=device, dtype=dtype, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    try:
        torch.optim.AdamW([probe], fused=True).step()
    except RuntimeError:  # "`fused=True` requires all the params to be floating point Tensors of supported devices"
        return False
    return True


def fused_supported(params, optimizer: str = "adamw") -> bool:
    """Whether torch's fused kernel of `optimizer` takes every parameter: floating point, on a device type that
    has them (CUDA, CPU, ...), and, for DTensor parameters, an optimizer whose fused op DTensor implements."""
    from torch.distributed.tensor import DTensor

    if optimizer not in DTENSOR_FUSED and any(isinstance(p, DTensor) for p in params):
        return False
    return all(fused_kernel_runs(p.device, p.dtype) for p in params)


def implementation_problems(cfg, uses_dtensor_parameters: bool):
    """Config problems of optim.implementation known before the model exists."""
    o = cfg.optim
    if o.implementation == "fused" and uses_dtensor_parameters and o.name not in DTENSOR_FUSED:
        return [f"optim.implementation=fused: torch has no fused {o.name} kernel for the DTensor parameters of "
                f"strategy={cfg.strategy.name}; use optim.implementation=auto (fused where it applies) or foreach"]
    return []


def implementation_kwargs(implementation: str, params, optimizer: str = "adamw") -> dict:
    """Keyword arguments choosing the kernel: `auto` takes the fused one where it applies (one kernel for all
    parameters; on CPU 4-5x faster than the per-parameter loop for a 100M model), else torch's default.
    An explicit `fused` where the kernel does not apply is a config problem, not an error deep inside torch."""
    if implementation == "fused" and not fused_supported(params, optimizer):
        kinds = sorted({f"{p.dtype} on {p.device.type}" for p in params})
        raise ConfigError([f"optim.implementation='fused': torch has no fused optimizer kernel for these parameters "
                           f"({', '.join(kinds)}); use optim.implementation=auto (fused where it applies) or foreach"])
    if implementation == "fused" or (implementation == "auto" and fused_supported(params, optimizer)):
        return {"fused": True}
    if implementation == "foreach":
        return {"foreach": True}
    if implementation == "for_loop":
        return {"foreach": False}
    return {}


def build_optimizer(cfg, named_params) -> torch.optim.Optimizer:
    o = cfg.optim
    groups = param_groups(named_params, o.weight_decay)
    kernel = implementation_kwargs(o.implementation, [p for g in groups for p in g["params"]], o.name)
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, **kernel)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, **kernel)
    raise ValueError(f"optim.name={o.name!r}")


def lr_factor(step: int, name: str, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if name == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if name == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"scheduler.name={name!r}")


def build_scheduler(cfg, optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    s = cfg.scheduler
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, s.name, s.warmup_steps, cfg.train.max_steps, s.min_lr_ratio))
