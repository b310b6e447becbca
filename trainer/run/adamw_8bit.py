"""optim.name=adamw_8bit: bitsandbytes' 8-bit AdamW (block-wise quantized moments, 2 bytes per parameter instead of
8; tensors under 4096 elements keep fp32 moments), with its step count held as a tensor as torch's optimizers hold
theirs: a checkpoint holds tensors only (trainer/checkpoint/safe_load.py refuses pickled Python objects), and
bitsandbytes keeps a Python int."""
from __future__ import annotations

import bitsandbytes
import torch


class AdamW8bit(bitsandbytes.optim.AdamW8bit):
    def init_state(self, group, p, gindex, pindex):
        super().init_state(group, p, gindex, pindex)
        self.state[p]["step"] = torch.zeros((), dtype=torch.float32)  # exact up to 2**24 steps

    def update_step(self, group, p, gindex, pindex):
        state = self.state[p]
        state["step"] = int(state["step"])  # its kernels take the count as a number
        try:
            super().update_step(group, p, gindex, pindex)
        finally:
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
