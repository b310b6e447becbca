"""One rank of test_preemption's agreement tests: a real SIGTERM (or a limit of its own) reaches this rank only, at
a chosen step."""
from __future__ import annotations

import os
import signal


def run(rank: int, world_size: int, store_path: str, signal_rank: int, signal_step: int, steps: int, results,
        how: str = "signal"):
    import torch.distributed as dist

    from trainer.resilience.preemption import StopRequest

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        stop = StopRequest()
        seen = []
        for step in range(1, steps + 1):
            if rank == signal_rank and step == signal_step:
                if how == "signal":
                    os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets the flag
                else:
                    stop.request("train.max_time_s")  # a rank's own limit, as the loop asks for it
            seen.append(stop.agreed())
        results[rank] = {"agreed": seen, "name": stop.name, "own_group": stop.group is not None}
        stop.restore()
    finally:
        dist.destroy_process_group()
