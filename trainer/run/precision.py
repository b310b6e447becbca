"""Precision policies: fp32, bf16 (autocast, fp32 master weights) and fp16 (autocast + dynamic loss scaling)."""
from __future__ import annotations

import copy
from contextlib import nullcontext

import torch

# The one map from a precision name (precision=, strategy.param_dtype / reduce_dtype, export.dtype) to its dtype.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(name: str):
    """The dtype autocast computes in under precision=`name`; None for fp32 (no autocast)."""
    return None if name == "fp32" else DTYPES[name]


def element_bytes(name: str) -> int:
    """Bytes per element of precision `name`'s dtype."""
    return DTYPES[name].itemsize


class Precision:
    def __init__(self, cfg, device: torch.device):
        p = cfg.precision
        self.name = p.name
        self.device_type = device.type
        self.autocast_dtype = autocast_dtype(p.name)
        self.scaler = None
        if p.name == "fp16":
            self.scaler = torch.amp.GradScaler(device.type, init_scale=p.init_scale, growth_factor=p.growth_factor,
                                               backoff_factor=p.backoff_factor, growth_interval=p.growth_interval)

    def with_cast_by_wrapper(self, cast_by_wrapper: bool) -> "Precision":
        """This policy for a model whose wrapper casts parameters to the compute dtype itself (FSDP's
        mixed-precision policy): the same loss scaling, no autocast on top. Otherwise itself."""
        if not cast_by_wrapper:
            return self
        other = copy.copy(self)
        other.autocast_dtype = None
        return other

    def autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_value(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss value that went through scale(), back in its own units (fp16's scale is a power of two by
        default, so this is exact)."""
        return loss / self.scaler.get_scale() if self.scaler is not None else loss

    def unscale_(self, optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> bool:
        """Step the optimizer unless fp16 gradients overflowed; returns True if the step was skipped."""
        if self.scaler is None:
            optimizer.step()
            return False
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() < before

    @property
    def loss_scale(self):
        return self.scaler.get_scale() if self.scaler is not None else None

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
