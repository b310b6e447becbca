"""SIGTERM / SIGINT during training: finish the step, save a checkpoint, exit cleanly.

The signal only sets a flag; at each step boundary the ranks agree (a one-element all-reduce) so that all of
them stop after the same step, even when the signal reached them at different moments. A second Ctrl-C
interrupts at once. The flag travels on the CPU (a gloo group of its own where the default group is NCCL): reading
a flag that sat on the GPU would wait for the whole step's kernels every step, and the host could no longer queue
the next step's work while the GPU is busy.
"""
from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist


class StopRequest:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = None
        self._previous = {}
        self.group = None  # collective: every rank constructs its StopRequest at the same point
        if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def agreed(self) -> bool:
        """True on every rank once any rank got a stop signal (collective: every rank calls it each step)."""
        local = self.signum is not None
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local
        flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        stop = bool(flag.item())
        if stop and self.signum is None:
            self.signum = signal.SIGTERM
        return stop

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
