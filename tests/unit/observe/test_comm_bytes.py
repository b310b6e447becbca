"""trainer/observe/comm_bytes.py: what a counted call adds, only inside a step's window, once for nested calls, and the
per-step mean a record gets."""
from __future__ import annotations

import torch

from trainer.observe.comm_bytes import CommCounter


def test_counts_the_named_argument_or_the_result_once_per_outer_call_and_only_in_the_window():
    counter = CommCounter()

    def inner(tensor):
        return tensor

    counted_inner = counter.counted(inner, "all_reduce", "tensor")

    def outer(output_tensor, input_tensor):  # a deprecated name forwarding to the new one
        counted_inner(input_tensor)
        return output_tensor

    counted_outer = counter.counted(outer, "all_gather", "output_tensor")
    gathered = counter.counted(lambda x: torch.cat([x, x]), "all_gather", "*")
    x = torch.zeros(10)  # 40 bytes
    counted_inner(x)
    assert counter.take() is None  # outside a step: nothing
    with counter.window():
        counted_inner(tensor=x)
        counted_outer(torch.zeros(4, 10, dtype=torch.float64), x)
        gathered(torch.zeros(3, dtype=torch.bfloat16))
    with counter.window():
        counted_inner([x, x])
    assert counter.take() == {"comm_bytes": (40 + 320 + 12 + 80) // 2,
                              "comm_bytes_by_kind": {"all_gather": 332 // 2, "all_reduce": 120 // 2}}
    assert counter.take() is None


def test_a_collective_among_one_rank_counts_nothing(one_rank_group):
    """A single-process ddp run reduces its gradient over a group of one: no bytes leave the rank."""
    import torch.distributed as dist

    counter = CommCounter()
    counted = counter.counted(dist.all_reduce, "all_reduce", "tensor")
    with counter.window():
        counted(torch.ones(10))
        counted(torch.ones(10), group=dist.group.WORLD)
    assert counter.take() == {"comm_bytes": 0, "comm_bytes_by_kind": {}}


def test_off_replaces_nothing_and_install_then_off_puts_the_originals_back():
    """logging.comm_bytes: configure(False) leaves torch.distributed's functions as they are (and takes back an
    earlier install), configure(True) wraps them; the module's counter counts only while installed."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import distributed_c10d

    from trainer.observe import comm_bytes
    from trainer.parallel.tensor_parallel import FUNCTIONAL_COLLECTIVES, count_functional_collectives

    originals = {name: getattr(dist, name) for name in comm_bytes.DISTRIBUTED if hasattr(dist, name)}
    funcol_originals = {name: getattr(funcol, name) for name in FUNCTIONAL_COLLECTIVES if hasattr(funcol, name)}
    try:
        comm_bytes.configure(False)
        count_functional_collectives()  # what a torch-native strategy's setup calls: nothing while off
        assert {name: getattr(dist, name) for name in originals} == originals
        assert {name: getattr(funcol, name) for name in funcol_originals} == funcol_originals
        assert not hasattr(distributed_c10d.all_reduce, "tessera_counted")
        with comm_bytes.COUNTER.window():
            comm_bytes.COUNTER.add("all_reduce", 40)  # torchft's reduction adds by hand
        assert comm_bytes.COUNTER.take() is None

        comm_bytes.configure(True)
        count_functional_collectives()
        assert dist.all_reduce.tessera_counted is originals["all_reduce"]
        assert dist.all_reduce is distributed_c10d.all_reduce
        assert funcol.all_reduce.tessera_counted is funcol_originals["all_reduce"]
        comm_bytes.configure(True)  # a second run in the process: wrapped once
        assert dist.all_reduce.tessera_counted is originals["all_reduce"]
        with comm_bytes.COUNTER.window():
            comm_bytes.COUNTER.add("all_reduce", 40)
        assert comm_bytes.COUNTER.take() == {"comm_bytes": 40, "comm_bytes_by_kind": {"all_reduce": 40}}

        comm_bytes.configure(False)
        assert {name: getattr(dist, name) for name in originals} == originals
        assert {name: getattr(distributed_c10d, name) for name in originals} == originals
        assert {name: getattr(funcol, name) for name in funcol_originals} == funcol_originals
    finally:
        comm_bytes.uninstall()
