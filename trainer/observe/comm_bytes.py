"""Bytes the collectives of a training step move, counted at the calls (`comm_bytes` in metrics.jsonl).

Opt-in: `logging.comm_bytes=true`. Off (the default), nothing in torch.distributed is replaced and metrics.jsonl
has no `comm_bytes`; build() calls `configure(False)`, which also undoes an earlier run's wrappers in the process.

On, `install()` wraps torch.distributed's public collective functions once per process, before any process group
or engine exists (DeepSpeed keeps references to them from its init). Every call adds the size of the tensor
it hands over to the counter of its kind: all-reduce, broadcast, reduce, send/recv and all-to-all count the
tensor given, all-gathers their full output, reduce-scatters their full input. This is the message size
(nccl-tests' "size"), not the wire bytes of an algorithm: a ring all-reduce sends 2(n-1)/n of it per rank.
A call made inside another counted call (torch's deprecated names forward to the new ones) counts once.

What this sees: FSDP2, DeepSpeed, pipeline send/recv, DDP's gradient buckets (Tessera's DDP always reduces
through a comm hook, which calls torch.distributed.all_reduce), the trainer's own reductions. Strategies whose
collectives go through other functions add them with `wrap` (DTensor's functional collectives in
trainer/parallel/tensor_parallel.py) or `add` (torchft's replica-group reduction). Collectives inside
torch.compile'd code are not seen; a strategy says so through its capabilities (`counts_all_collectives`).

Why wrappers and not torch's dispatch-level tools (CommDebugMode, a TorchDispatchMode on the c10d ops): such a
mode does see every collective here on CPU/gloo (checked with torch 2.13: DDP's reducer reaches c10d.allreduce_
through the dispatcher, FSDP2 c10d._allgather_base_ / _reduce_scatter_base_, DeepSpeed's and the trainer's calls
the same ops), but it sees them by routing every aten op of the step through Python: about 20 us an op, a tiny
llama step (718 ops) 2.3x slower, a 4-layer 256-wide one 1.3x, where the wrappers cost one Python call per
collective. Its numbers would also differ from the calls' at the edges this module settles (a single-rank group,
a list argument against the op's flattened one, DTensor's redistributions seen only when the mode steps aside).

The cost on: one Python call per collective, a few dozen per step (benchmarks/README.md, "comm_bytes overhead").
"""
from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

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

    def __init__(self, enabled: bool = True):
        self.enabled = enabled  # off: windows count nothing and take() has nothing to give
        self.by_kind: Dict[str, int] = {}
        self.steps = 0
        self.active = False
        self._local = threading.local()

    def add(self, kind: str, nbytes: int) -> None:
        if self.active:
            self.by_kind[kind] = self.by_kind.get(kind, 0) + int(nbytes)

    @contextmanager
    def window(self):
        if not self.enabled:
            yield
            return
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


COUNTER = CommCounter(enabled=False)  # install() turns it on
_REPLACED: List[Tuple[object, str, object]] = []  # (module, name, the function before install / wrap)


def _replace(module, name: str, value) -> None:
    _REPLACED.append((module, name, getattr(module, name)))
    setattr(module, name, value)


def wrap(module, functions: Dict[str, tuple]) -> None:
    """Replace each `module.<name>` with a counting wrapper (once; a wrapped function stays wrapped). Nothing
    unless install() ran: with logging.comm_bytes off no function is replaced."""
    if not COUNTER.enabled:
        return
    for name, (kind, arg) in functions.items():
        fn = getattr(module, name, None)
        if fn is None or hasattr(fn, "tessera_counted"):
            continue
        _replace(module, name, COUNTER.counted(fn, kind, arg))


def configure(on: bool) -> None:
    """logging.comm_bytes: install() when on; off, the original functions back (a process may run several
    jobs: tests/integration/arch_worker.py) and a counter that counts nothing."""
    if on:
        install()
    else:
        uninstall()


def uninstall() -> None:
    """Put back every function install() / wrap() replaced, and turn the counter off."""
    while _REPLACED:
        module, name, original = _REPLACED.pop()
        setattr(module, name, original)
    COUNTER.enabled = False
    COUNTER.active = False
    COUNTER.by_kind, COUNTER.steps = {}, 0


def install() -> None:
    """Count torch.distributed's collectives in this process (both names a function is reached by)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d

    COUNTER.enabled = True
    present = {name: spec for name, spec in DISTRIBUTED.items() if hasattr(distributed_c10d, name)}
    wrap(distributed_c10d, present)
    for name in present:
        fn = getattr(dist, name, None)
        if fn is not None and fn is not getattr(distributed_c10d, name):
            _replace(dist, name, getattr(distributed_c10d, name))
