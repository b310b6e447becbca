"""Whether a config runs with its strategy: the strategy's Capabilities (trainer/strategies/capabilities.py)
against the keys that need them, checked here in one place before any process group starts, plus the strategy's
own layout checks (`layout_problems`). Every problem names the key and what to set instead."""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import replace
from typing import List

import torch

from models.lora import quantization_problems
from tessera.errors import ConfigError
from trainer.config.schema import ZERO_PLUS_PLUS_OFF
from trainer.parallel import replica_groups
from trainer.parallel.dims import select_device
from trainer.parallel.sync import sync_problems

DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
FSDP_OPTIONS = (("cpu_offload", False), ("param_dtype", None), ("reduce_dtype", None))


def strategy_problems(cls, cfg, world_size: int) -> List[str]:
    """Every problem of `cfg` with strategy class `cls` (the registry's class for strategy.name)."""
    caps = cls.capabilities_for(cfg)
    problems = option_problems(cfg, caps)
    plain = cls.capabilities_for(without_model_parallel(cfg))
    problems += sync_problems(cfg, caps.periodic_sync, plain.periodic_sync)
    problems += fault_tolerance_problems(cfg, cls.capabilities.fault_tolerance, caps.fault_tolerance)
    problems += step_problems(cfg, caps)
    return problems + cls.layout_problems(cfg, world_size)


def without_model_parallel(cfg):
    """`cfg` with strategy.tp=1 and strategy.pp=1 (to say when tensor or pipeline parallelism is what rules out
    a feature)."""
    return replace(cfg, strategy=replace(cfg.strategy, tp=1, pp=1))


def option_problems(cfg, caps) -> List[str]:
    """Degrees and strategy.* options that only other strategies use."""
    s, problems = cfg.strategy, []
    for key in DEGREES:
        value = getattr(s, key)
        if value not in (1, -1) and key not in caps.degrees:
            problems.append(f"strategy={s.name} does not use strategy.{key} (got {value}); set it to 1 "
                            f"or pick a strategy that does")
    if not caps.fsdp_options:
        for key, unset in FSDP_OPTIONS:
            if getattr(s, key) != unset:
                problems.append(f"strategy.{key}={getattr(s, key)} is an FSDP option; strategy={s.name} does not "
                                f"use it: leave it unset"
                                + (" (DeepSpeed: strategy.offload_optimizer / offload_param)"
                                   if key == "cpu_offload" else ""))
    if not caps.zero_options:
        for key, off in ZERO_PLUS_PLUS_OFF.items():
            if getattr(s, key) != off:
                problems.append(f"strategy.{key} is a ZeRO++ option of strategy=zero3; strategy={s.name} does not "
                                f"use it: leave it unset")
    if s.comm_hook != "none" and s.comm_hook not in caps.comm_hooks:
        problems.append(f"strategy.comm_hook={s.comm_hook} is a DDP communication hook; strategy={s.name} cannot "
                        f"use it: use strategy=ddp, or strategy.reduce_dtype=bf16 with fsdp/hsdp (the gradient "
                        f"reduce-scatter in bf16), or leave strategy.comm_hook=none")
    return problems


def fault_tolerance_problems(cfg, offered, here) -> List[str]:
    """strategy.fault_tolerance against what the strategy offers (`offered`) and runs with in this layout."""
    ft = cfg.strategy.fault_tolerance
    if ft != "none" and ft not in here:
        return [f"strategy.fault_tolerance={ft} is not available with strategy={cfg.strategy.name}"
                f"{' and tensor or pipeline parallelism' if ft in offered else ''}; use strategy=ddp or "
                f"strategy=hsdp (replica groups), or strategy.fault_tolerance=none with train.max_restarts "
                f"(restarts from the last checkpoint)"]
    return replica_groups.config_problems(cfg) if ft == "torchft" else []


def step_problems(cfg, caps) -> List[str]:
    """train.on_nonfinite=skip, peft's quantization and train.compile with this strategy."""
    problems, name = [], cfg.strategy.name
    if cfg.train.on_nonfinite == "skip" and not caps.skips_nonfinite_steps:
        problems.append(f"train.on_nonfinite=skip is not available with strategy={name} and "
                        f"precision={cfg.precision.name} (the step is taken inside the engine); use "
                        f"train.on_nonfinite=stop, or precision=fp16, whose loss scaler skips such steps")
    if cfg.peft.name != "none" and cfg.peft.quantization != "none":
        problems += quantization_strategy_problems(cfg, caps)
    if cfg.train.compile:
        if not caps.compile:
            problems.append(f"train.compile=true is not available with strategy={name}; set train.compile=false")
        else:
            problems += compile_problems(cfg.train.device)
    return problems


def quantization_strategy_problems(cfg, caps) -> List[str]:
    """peft.quantization (QLoRA) with this strategy, and on the device the run would use."""
    if not caps.holds_whole_model:
        return [f"peft.quantization={cfg.peft.quantization} (QLoRA) is available with strategy=single or ddp, "
                f"which hold the 4-bit base whole on each rank (bitsandbytes' 4-bit weights are not sharded by "
                f"strategy={cfg.strategy.name}); use one of them or peft.quantization=none"]
    try:
        device = select_device(cfg.train.device)
    except ConfigError:
        return []  # the device's own problem is reported with the train.* keys
    return quantization_problems(device)


def preflight(cfg) -> None:
    """What the run needs outside this job, checked before any process group (raises a TesseraError): a torchft
    lighthouse that cannot be reached is an error now, not a hang in the first quorum."""
    if cfg.strategy.fault_tolerance == "torchft":
        replica_groups.check_lighthouse(cfg.strategy)


def compile_problems(device_spec: str) -> List[str]:
    """Whether torch.compile (inductor) can run here: dynamo on this Python, Triton for CUDA, a C++ compiler
    for the CPU."""
    if not torch._dynamo.is_dynamo_supported():  # torch offers this check only under torch._dynamo
        return ["train.compile=true: torch.compile does not support this Python/platform; set train.compile=false"]
    cuda = device_spec.startswith("cuda") or (device_spec == "auto" and torch.cuda.is_available())
    if cuda:
        from torch.utils._triton import has_triton  # inductor's own check (usable Triton for this device)

        if not has_triton():
            return ["train.compile=true needs Triton on CUDA, which is not installed; set train.compile=false or "
                    "install triton"]
        return []
    # Inductor runs exactly $CXX (default g++, clang++ on macOS), with no fallback to another compiler
    # (torch._inductor.config.cpp.cxx); with TORCH_INDUCTOR_INSTALL_GXX it may fetch g++ from conda itself.
    cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    if not shutil.which(cxx) and not os.environ.get("TORCH_INDUCTOR_INSTALL_GXX"):
        return [f"train.compile=true on the CPU needs the C++ compiler {cxx!r} ($CXX, default g++), which is not "
                f"on PATH; install it, point CXX at one, or set train.compile=false"]
    return []
