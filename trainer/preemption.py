"""SIGTERM / SIGINT during training: finish the step, save a checkpoint, exit cleanly.

The signal only sets a flag; at each step boundary the ranks agree (a one-element all-reduce) so that all of
them stop after the same step, even when the signal reached them at different moments. A second Ctrl-C
interrupts at once.
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

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank got a stop signal (collective: every rank calls it each step)."""
        local = self.signum is not None
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and self.signum is None:
            self.signum = signal.SIGTERM
        return flag.item() > 0

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
