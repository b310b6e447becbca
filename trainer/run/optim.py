"""Optimizers (AdamW, SGD, Adafactor, Muon with AdamW, bitsandbytes' 8-bit AdamW) and learning-rate schedules
(constant, linear, cosine; each with linear warmup). What each optimizer needs of the parameters it steps is checked
against the layout before any process group starts (`optimizer_problems`)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import List

import torch

from tessera.errors import ConfigError
from trainer.run.muon import build_muon
from trainer.strategies.capabilities import DTENSORS, FLAT_PARTITIONS

IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")
KERNELS = IMPLEMENTATIONS[1:]  # what an explicit optim.implementation names


@dataclass(frozen=True)
class Stepping:
    """What an optimizer needs of its parameters: `matrices` says why it needs each weight matrix in its shape
    ("": it works element by element), `dtensors` why it cannot step DTensor parameters ("": it can); `kernels`:
    the optim.implementation values it has besides auto; `layouts`: where it runs (for the messages)."""
    matrices: str = ""
    dtensors: str = ""
    kernels: tuple = KERNELS
    layouts: str = "every strategy"


STEPPING = {
    "adamw": Stepping(),
    "sgd": Stepping(),
    "adafactor": Stepping(matrices="it factors each matrix's second moment into row and column means",
                          dtensors="torch's Adafactor has no DTensor rules (its in-place norm of a sharded "
                                   "parameter fails)",
                          kernels=("foreach", "for_loop"),
                          layouts="strategy=single, ddp or pp (pipeline stages without FSDP)"),
    "muon": Stepping(matrices="it orthogonalises each matrix's update (Newton-Schulz)",
                     layouts="strategy=single, ddp or a torch-native layout (fsdp, hsdp, tp, pp and hybrids)"),
    "adamw_8bit": Stepping(dtensors="bitsandbytes' 8-bit kernels have no DTensor rules", kernels=(),
                           layouts="strategy=single, ddp, pp (pipeline stages without FSDP) or a ZeRO strategy"),
}
OPTIMIZERS = tuple(STEPPING)


def optimizer_problems(cfg, parameters: str) -> List[str]:
    """optim.name and optim.implementation against what the layout hands the optimizer (`parameters`: whole tensors,
    DTensors or ZeRO's flat partitions; Strategy.optimizer_parameters)."""
    o, need = cfg.optim, STEPPING.get(cfg.optim.name)
    if need is None:
        return []  # the schema's choices name it
    problems = []
    if parameters == FLAT_PARTITIONS and need.matrices:
        problems.append(f"optim.name={o.name}: {need.matrices}, but strategy={cfg.strategy.name} hands the "
                        f"optimizer ZeRO's flat 1-D partitions of all parameters; use {need.layouts}, or "
                        f"optim.name=adamw")
    elif parameters == DTENSORS and need.dtensors:
        problems.append(f"optim.name={o.name}: {need.dtensors}, and strategy={cfg.strategy.name} steps DTensors "
                        f"here (FSDP or tensor parallelism); use {need.layouts}, or optim.name=adamw")
    if o.implementation != "auto" and o.implementation not in need.kernels:
        have = ", ".join(need.kernels) if need.kernels else "none but its own"
        problems.append(f"optim.implementation={o.implementation}: optim.name={o.name} has no such kernel (its "
                        f"kernels: {have}); use optim.implementation=auto")
    elif o.implementation == "fused" and parameters == DTENSORS and _fused_kernel(o.name) not in DTENSOR_FUSED:
        problems.append(f"optim.implementation=fused: torch has no fused {o.name} kernel for the DTensor parameters "
                        f"of strategy={cfg.strategy.name}; use optim.implementation=auto (fused where it applies) "
                        f"or foreach")
    return problems


def param_groups(named_params, weight_decay: float):
    """Weight decay on matrices only: biases, norms' gains and 1-D parameters are not decayed. Each group says
    whether it decays (`decays`), so a resumed run applies a changed optim.weight_decay to the right groups."""
    decay, no_decay = [], []
    for _, p in named_params:
        if not p.requires_grad:
            continue
        shape = getattr(p, "ds_shape", p.shape)  # a ZeRO-3 partition is 1-D; its full shape says what it is
        (decay if len(shape) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "decays": True},
              {"params": no_decay, "weight_decay": 0.0, "decays": False}]
    return [g for g in groups if g["params"]]


def configured_values(group: dict, o) -> dict:
    """The optim.* values a param group takes from the config (a resumed run re-applies them): Muon's momentum,
    SGD's momentum, AdamW's (and 8-bit AdamW's) betas and eps; Adafactor's eps and decay rates are its own."""
    if "ns_steps" in group:  # Muon (its eps is Newton-Schulz's, not optim.eps)
        return {"momentum": o.momentum, "nesterov": o.nesterov}
    if "beta2_decay" in group:  # Adafactor
        return {}
    if "betas" in group:
        return {"betas": tuple(o.betas), "eps": o.eps}
    if "momentum" in group:
        return {"momentum": o.momentum, "nesterov": o.nesterov}
    return {}


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


def implementation_kwargs(implementation: str, params, optimizer: str = "adamw") -> dict:
    """Keyword arguments choosing the kernel: `auto` takes the fused one where it applies (one kernel for all
    parameters; on CPU 4-5x faster than the per-parameter loop for a 100M model), else torch's default.
    An explicit `fused` where the kernel does not apply is a config problem, not an error deep inside torch."""
    if "fused" not in STEPPING[optimizer].kernels:  # Adafactor: foreach or the loop; bitsandbytes: its own
        return {"foreach": implementation == "foreach"} if implementation in ("foreach", "for_loop") else {}
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


def build_optimizer(cfg, named_params, embeddings=()) -> torch.optim.Optimizer:
    """The optimizer of the trainable parameters among `named_params`; `embeddings`: the names of the input
    embedding and LM head weights (models.plans.embedding_weight_names; Muon leaves them to AdamW)."""
    o = cfg.optim
    if o.name not in STEPPING:
        raise ValueError(f"optim.name={o.name!r}")
    named = [(n, p) for n, p in named_params if p.requires_grad]
    if o.name == "muon":
        matrices, adamw = [], []
        for n, p in named:
            (matrices if _muon_matrix(n, p, embeddings) else adamw).append((n, p))
        return build_muon(o, [p for _, p in matrices], param_groups(adamw, o.weight_decay),
                          implementation_kwargs(o.implementation, [p for _, p in adamw], "adamw"))
    groups = param_groups(named, o.weight_decay)
    kernel = implementation_kwargs(o.implementation, [p for g in groups for p in g["params"]], o.name)
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, **kernel)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, **kernel)
    if o.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=o.lr, **kernel)
    from trainer.run.adamw_8bit import AdamW8bit  # adamw_8bit runs only (bitsandbytes: start-up)

    return AdamW8bit(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)


def _fused_kernel(name: str) -> str:
    """The torch optimizer whose fused kernel optim.implementation=fused picks (Muon's: its AdamW part's)."""
    return "adamw" if name == "muon" else name


def _muon_matrix(name: str, p, embeddings) -> bool:
    """Muon steps the 2-D weights but the embeddings and the LM head (as its authors do); AdamW the rest."""
    return p.dim() == 2 and name not in embeddings


def state_bytes(name: str, shape, embedding: bool = False, momentum: float = 0.9) -> int:
    """Bytes of optimizer state `name` keeps for one parameter of `shape` (the planner's figure; the memory report
    measures the same tensors)."""
    n = math.prod(shape)
    if name == "muon":  # momentum for the matrices it steps, AdamW's state for the rest
        return 4 * n if len(shape) == 2 and not embedding else state_bytes("adamw", shape)
    if name == "adamw":
        return 8 * n + 4  # exp_avg, exp_avg_sq, step
    if name == "sgd":
        return 4 * n if momentum else 0
    if name == "adafactor":  # row and column means of each matrix (of each matrix in a stack), else the variance
        rows = math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1] if len(shape) >= 2 else n
        return 4 * rows + 4
    if name == "adamw_8bit":  # uint8 moments with an fp32 scale per block of 256 (the two 256-entry quantization
        # maps are shared by every tensor: 2 KiB in all); tensors under 4096 elements keep fp32 moments
        return (2 * n + 2 * 4 * -(-n // 256) if n >= 4096 else 8 * n) + 4
    raise ValueError(f"optim.name={name!r}")


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
