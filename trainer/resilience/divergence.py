"""The divergence guard: a run whose loss or gradient norm stops being finite (or whose loss spikes) stops after
its last finite checkpoint instead of training on, rotating good checkpoints away and exporting NaNs.

The gradient norm is the global one (the same on every rank), so every rank reaches the same verdict without a
collective of its own. In `train.on_nonfinite=stop` mode the per-step flag stays on the device and is read only
where the verdict matters: at logged steps, before every checkpoint save and before the end (no host sync per
step). Checkpoints are therefore only ever written from finite weights, and the newest of them is pinned (kept
out of `checkpoint.keep_last` rotation) when the run stops. In `skip` mode the strategy itself skips a step whose
gradient is not finite (no update), which reads the norm every step.
"""
from __future__ import annotations

import math
from collections import deque

import torch

from tessera.errors import DivergenceError

SPIKE_WINDOW = 20  # logged losses the spike check averages over
SPIKE_MIN_HISTORY = 5  # logged losses needed before a spike can be judged


class DivergenceGuard:
    """`checkpointer`: the run's CheckpointManager (wait, pin_newest); `log`: one line to the run's log;
    `spike_factor`: train.loss_spike_factor; `announce_skips`: name each step skipped for a non-finite gradient
    (train.on_nonfinite=skip without a loss scaler, whose overflow skips are routine)."""

    def __init__(self, checkpointer, log, spike_factor: float, announce_skips: bool = False):
        self.checkpointer, self.log = checkpointer, log
        self.spike_factor = spike_factor
        self.announce_skips = announce_skips
        self.bad = None  # device flag: a step since the last check had a non-finite norm that was not skipped
        self.first_bad_step = None
        self.history = deque(maxlen=SPIKE_WINDOW)

    def observe(self, step: int, grad_norm, skipped: bool) -> None:
        """After each optimizer step. A skipped step (fp16 overflow, or on_nonfinite=skip) is no divergence."""
        if skipped:
            if self.announce_skips:
                self.log(f"step {step}: non-finite gradient norm; step skipped (train.on_nonfinite=skip)")
            return
        flag = ~torch.isfinite(torch.as_tensor(grad_norm).detach())
        self.bad = flag if self.bad is None else self.bad | flag
        if self.first_bad_step is None and self.bad.device.type == "cpu" and bool(self.bad):
            self.first_bad_step = step

    def check_logged(self, step: int, loss: float, skipped: bool) -> None:
        """At a logged step: the global loss must be finite and not a spike (a skipped step's loss is not judged:
        the step changed nothing)."""
        if skipped:
            self.check(step)
            return
        if not math.isfinite(loss):
            self._stop(step, f"the loss is {loss}")
        if self.spike_factor > 0 and len(self.history) >= SPIKE_MIN_HISTORY:
            mean = sum(self.history) / len(self.history)
            if loss > self.spike_factor * mean:
                self._stop(step, f"the loss {loss:.4f} is over train.loss_spike_factor={self.spike_factor:g} x the "
                                 f"mean of the last {len(self.history)} logged losses ({mean:.4f})")
        self.history.append(loss)
        self.check(step)

    def check(self, step: int) -> None:
        """Before a save and at the end: no non-finite gradient norm since the last check."""
        if self.bad is not None and bool(self.bad):
            at = self.first_bad_step or step
            self._stop(step, f"the gradient norm was not finite (first seen by step {at})")
        self.bad = None

    def _stop(self, step: int, what: str) -> None:
        self.checkpointer.wait()  # a save in flight holds finite weights: let it finish
        kept = self.checkpointer.pin_newest(f"last finite checkpoint before divergence at step {step}")
        where = (f"the last finite checkpoint, {kept}, is kept (out of checkpoint.keep_last rotation); resume from "
                 f"it with checkpoint.resume={kept}" if kept else "no checkpoint was saved before it")
        hint = ("lower optim.lr, raise scheduler.warmup_steps or lower train.grad_clip; or set "
                "train.on_nonfinite=skip to skip such steps")
        raise DivergenceError(f"training diverged at step {step}: {what}. Stopped without saving or exporting; "
                              f"{where}. To go on: {hint}")
