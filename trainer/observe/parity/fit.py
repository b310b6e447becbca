"""Does a side fit this machine? The planner's estimate (trainer/planner/estimate.py) of a side's memory against
what the machine has: on a GPU, each rank's device memory against the device's; on CPU, every rank's share together
against the memory available now. A side that does not fit makes the parity check run on a shrunk copy of the model
(shrink.py), said in the report; --no-shrink refuses instead."""
from __future__ import annotations

from typing import Optional

import torch
from omegaconf import OmegaConf

from models import registry
from trainer.config.schema import to_object
from trainer.planner.estimate import estimate

GIB = 2**30
HEADROOM = 0.8  # the estimate leaves out the allocator's and the libraries' own memory


def available_bytes() -> float:
    """Memory one machine offers a side: a GPU's total (per rank), or the host's available memory (all ranks)."""
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return float("inf")


def needed_bytes(cfg: dict, nproc: int) -> float:
    """The planner's estimate for the side: per rank on a GPU, every rank together on CPU."""
    typed = to_object(OmegaConf.create(cfg))
    info = registry.describe(typed.model, registry.load_tokenizer(typed.model))
    per_rank = estimate(typed, nproc, info).device_total
    return per_rank if torch.cuda.is_available() else per_rank * nproc


def too_big(sides) -> Optional[str]:
    """None when every (cfg, nproc) side fits; else why not, for the report."""
    have = available_bytes() * HEADROOM
    for label, cfg, nproc in sides:
        need = needed_bytes(cfg, nproc)
        if need > have:
            return (f"side {label} needs about {need / GIB:.1f} GiB by the planner's estimate, more than the "
                    f"{have / GIB:.1f} GiB usable here")
    return None
