"""Precision policies: fp32, bf16 (autocast, fp32 master weights) and fp16 (autocast + dynamic loss scaling)."""
from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import List

import torch
from torch import nn

from models.init import buffers_in_model_dtype

# The one map from a precision name (precision=, strategy.param_dtype / reduce_dtype, export.dtype) to its dtype.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(name: str):
    """The dtype autocast computes in under precision=`name`; None for fp32 (no autocast)."""
    return None if name == "fp32" else DTYPES[name]


def element_bytes(name: str) -> int:
    """Bytes per element of precision `name`'s dtype."""
    return DTYPES[name].itemsize


@torch.no_grad()
def cast_buffers_in_model_dtype(models: List[nn.Module], dtype) -> None:
    """Where a wrapper casts the parameters to `dtype` and no autocast runs (FSDP's mixed-precision policy,
    DeepSpeed's bf16/fp16), the buffers Hugging Face keeps in the model's dtype go to `dtype` too, as a model
    loaded with from_pretrained(dtype=...) holds them: left in fp32, such a table turns the activations it meets
    into fp32 (XGLM's positions: a layer norm with bf16 weights then fails) or fails a matmul (MiniMax's decays).
    `models`: Hugging Face causal LMs of one config (or peft models around them: a rank's pipeline stages); their
    buffers are listed once. Nothing to do in fp32."""
    if dtype is None or dtype == torch.float32 or not models:
        return
    bases = [m.get_base_model() if hasattr(m, "get_base_model") else m for m in models]  # peft: the names under it
    names = set(buffers_in_model_dtype(bases[0].config))
    for base in bases:
        for name, buffer in base.named_buffers():
            if name in names and buffer.is_floating_point():
                buffer.data = buffer.data.to(dtype)


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
