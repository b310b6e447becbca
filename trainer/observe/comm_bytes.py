"""Bytes the collectives of a training step move, counted at the calls (`comm_bytes` in metrics.jsonl).

`install()` wraps torch.distributed's public collective functions once per process, before any process group
or engine exists (DeepSpeed keeps references to them from its init). Every call adds the size of the tensor
it hands over to the counter of its kind: all-reduce, broadcast, reduce, send/recv and all-to-all count the
tensor given, all-gathers their full output, reduce-scatters their full input. This is the message size
(nccl-tests' "size"), not the wire bytes of an algorithm: a ring all-reduce sends 2(n-1)/n of it per rank.
A call made inside another counted call (torch's deprecated names forward to the new ones) counts once.

What this sees: FSDP2, DeepSpeed, pipeline send/recv, DDP's gradient buckets (Tessera's DDP always reduces
through a comm hook, which calls torch.distributed.all_reduce), the trainer's own reductions. Strategies whose
collectives go through other functions add them with `wrap` (DTensor's functional collectives in
torch_native.py) or `add` (torchft's replica-group reduction). Collectives inside torch.compile'd code are not
seen; a strategy says so through `Strategy.counts_all_collectives`.

The cost is one Python call per collective, a few dozen per step: cheap enough to leave on.
"""
from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager
from typing import Dict, Optional

import torch

# public torch.distributed function -> (kind, the argument counted; "*" = the call's result)
DISTRIBUTED = {
    "all_reduce": ("all_reduce", "tensor"), "all_reduce_coalesced": ("all_reduce", "tensors"),
    "reduce": ("reduce", "tensor"), "broadcast": ("broadcast", "tensor"),
    "all_gather": ("all_gather", "tensor_list"), "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"), "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"), "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"), "all_to_all": ("all_to_all", "input_tensor_list"),
    "gather": ("gather", "tensor"), "scatter": ("scatter", "tensor"),
    "send": ("p2p", "tensor"), "recv": ("p2p", "tensor"), "isend": ("p2p", "tensor"), "irecv": ("p2p", "tensor"),
}


class CommCounter:
    """Bytes per collective kind since the window opened. Counting happens only inside `window()`: a training
    step's forward, backward and optimizer step, not evaluation or checkpoint saves."""

    def __init__(self):
        self.by_kind: Dict[str, int] = {}
        self.steps = 0
        self.active = False
        self._local = threading.local()

    def add(self, kind: str, nbytes: int) -> None:
        if self.active:
            self.by_kind[kind] = self.by_kind.get(kind, 0) + int(nbytes)

    @contextmanager
    def window(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self.steps += 1

    def take(self) -> Optional[dict]:
        """{"comm_bytes": mean bytes per step since the last take, "comm_bytes_by_kind": {...}}, then reset."""
        if not self.steps:
            return None
        steps, by_kind = self.steps, self.by_kind
        self.by_kind, self.steps = {}, 0
        per_step = {k: v // steps for k, v in sorted(by_kind.items())}
        return {"comm_bytes": sum(v for v in by_kind.values()) // steps, "comm_bytes_by_kind": per_step}

    def counted(self, fn, kind: str, arg: str):
        """`fn` counting the bytes of its argument `arg` (or of its result, arg "*") as `kind`."""
        index = None
        names = list(inspect.signature(fn).parameters)
        if arg != "*":
            index = names.index(arg)
        group_index = names.index("group") if "group" in names else None
        local = self._local

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not self.active or torch.compiler.is_compiling() or getattr(local, "inside", False):
                return fn(*args, **kwargs)
            local.inside = True
            try:
                out = fn(*args, **kwargs)
            finally:
                local.inside = False
            if group_index is not None:
                group = args[group_index] if len(args) > group_index else kwargs.get("group")
                if _single_rank(group):  # a collective among one rank hands nothing over
                    return out
            value = out if index is None else (args[index] if len(args) > index else kwargs.get(arg))
            self.add(kind, tensor_bytes(value))
            return out

        wrapper.tessera_counted = fn
        return wrapper


def _single_rank(group) -> bool:
    """Whether a torch.distributed group (None: the default one) has one rank; False when that can't be told
    (no process group, or another kind of group argument: a functional collective's mesh)."""
    import torch.distributed as dist

    if group is not None and not isinstance(group, dist.ProcessGroup):
        return False
    try:
        return dist.get_world_size(group) == 1
    except (RuntimeError, ValueError):
        return False


def tensor_bytes(value) -> int:
    """Bytes of a tensor or of the tensors in a list/tuple (a DTensor: its local part)."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "to_local"):
            value = value.to_local()
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


COUNTER = CommCounter()


def wrap(module, functions: Dict[str, tuple]) -> None:
    """Replace each `module.<name>` with a counting wrapper (once; a wrapped function stays wrapped)."""
    for name, (kind, arg) in functions.items():
        fn = getattr(module, name, None)
        if fn is None or hasattr(fn, "tessera_counted"):
            continue
        setattr(module, name, COUNTER.counted(fn, kind, arg))


def install() -> None:
    """Count torch.distributed's collectives in this process (both names a function is reached by)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d

    present = {name: spec for name, spec in DISTRIBUTED.items() if hasattr(distributed_c10d, name)}
    wrap(distributed_c10d, present)
    for name in present:
        if getattr(dist, name, None) is not None:
            setattr(dist, name, getattr(distributed_c10d, name))
