"""The opt-in memory report (`logging.memory_report=true`): per-rank model-state bytes of the first step, one log
line and `<run dir>/memory.json`. With the key off, nothing here runs.

Each strategy states what its rank holds (`Strategy.model_state_bytes()`: bytes per category in CATEGORIES, read
through public APIs) and arms its own probe points (`Strategy.watch_memory(snap)`); this module adds the optimizer
step (a torch optimizer step post-hook: gradients and optimizer state both exist) and the point after the step,
keeps per category the peak over every snapshot, gathers the ranks and writes the file.

memory.json: world_size, dp_size, strategy, precision, num_params, largest_layer_params, step, and `ranks`: per
rank the peak bytes per category, `model_states` (params + grads + optimizer + master_params, what the ZeRO
paper's formulas count), `total`, `peak_point` (where each peak was taken), `points` (each point's snapshot),
`errors`, `built_params` (parameter bytes held right after model construction); plus the strategy's own
`memory_layout()` entries (FSDP2: `fsdp`).
"""
from __future__ import annotations

import json
import os
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tessera.errors import one_line
from trainer.observe.model_states import CATEGORIES, memory_layout, state_bytes

MODEL_STATES = ("params", "grads", "optimizer", "master_params")  # what the ZeRO paper's formulas count


class FirstStepProbe:
    """Snapshots of the strategy's model-state bytes at named points of one step: per point the largest (by
    total), per category the largest over every snapshot and the point it was taken at."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.snapshots: Dict[str, dict] = {}
        self.peaks: Dict[str, int] = {}
        self.peak_point: Dict[str, str] = {}
        self.errors: List[str] = []
        optimizer = strategy.optimizer  # DeepSpeed: the client optimizer that ZeRO steps on its fp32 partitions
        self.undo = [optimizer.register_step_post_hook(lambda *_: self.snap("optimizer_step")).remove]
        self.undo += strategy.watch_memory(self.snap)
        self.activations = SavedActivations()
        self.undo.append(self.activations.close)

    def snap(self, point: str) -> None:
        try:  # runs inside the step: a failure to measure must never fail training
            figures = state_bytes(self.strategy)
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"{point}: {one_line(e)}")
            return
        m = {c: int(figures.get(c, 0)) for c in CATEGORIES}
        m["total"] = sum(m.values())
        if point not in self.snapshots or m["total"] > self.snapshots[point]["total"]:
            self.snapshots[point] = m
        for c in CATEGORIES:
            if c not in self.peaks or m[c] > self.peaks[c]:
                self.peaks[c], self.peak_point[c] = m[c], point

    def report(self) -> dict:
        """This rank's entry of memory.json (disarms the probes; takes the `after_step` snapshot)."""
        for undo in self.undo:
            undo()
        self.undo = []
        self.snap("after_step")
        out = {c: self.peaks.get(c, 0) for c in CATEGORIES}
        out["model_states"] = sum(out[c] for c in MODEL_STATES)
        out["total"] = sum(out[c] for c in CATEGORIES)
        out["activations"] = self.activations.peak  # not in total: not model state
        out.update(peak_point=dict(self.peak_point), points=self.snapshots, errors=self.errors)
        return out


class SavedActivations:
    """What autograd keeps for backward during the first step: bytes of the distinct storages held by saved
    tensors (a saved-tensor hook packs each into a holder that autograd frees with the node), parameters, their
    views and casts left out; `peak` is the most held at once: one micro-batch's forward and loss where micro-batches
    run one after another, every micro-batch a pipeline schedule keeps in flight on this rank's stages. Inside a
    checkpointed block torch's checkpoint keeps its own (the block's input here; its recomputation, not seen)."""

    def __init__(self):
        self.peak = self.current = 0
        self.holders = {}  # storage address -> [holders alive, bytes]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _Held.unpack)
        self.hooks.__enter__()

    def _pack(self, t):
        try:  # runs inside autograd: a tensor it cannot measure must never fail training
            key = self._hold(t)
        except Exception:  # noqa: BLE001 - a subclass without a storage of its own: not counted
            key = None
        return t if key is None else _Held(t, key, self)

    def _hold(self, t):
        if t.device.type == "meta" or _parameter_data(t):
            return None
        if isinstance(t, DTensor):  # a wrapper: its storage is the local part's
            with torch.no_grad():
                t = t.to_local()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self.holders.setdefault(key, [0, storage.nbytes()])
        if not entry[0]:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return key

    def release(self, key) -> None:
        entry = self.holders.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if not entry[0]:
            self.current -= entry[1]
            del self.holders[key]

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
            self.hooks = None


def _parameter_data(t) -> bool:
    """A parameter (frozen or not), a view of one (a linear layer's transposed weight) or autocast's cast of a
    trained one (its bf16 copy of an fp32 weight): model state, not activations."""
    base = t if t._base is None else t._base
    if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
        return True
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    source = fn.next_functions[0][0]
    return source is not None and type(source).__name__ == "AccumulateGrad"


class _Held:
    """A saved tensor while autograd keeps it: freed with its graph node, when its bytes stop counting."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor, key, owner):
        self.tensor, self.key, self.owner = tensor, key, owner

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def __del__(self):
        self.owner.release(self.key)


def largest_layer_params(model_shapes: dict) -> int:
    """Parameters (and buffers) of the largest module by its own tensors, full sizes, from the model's shapes."""
    per_module: Dict[str, int] = {}
    for name, shape in model_shapes.items():
        numel = 1
        for n in shape:
            numel *= n
        module = name.rpartition(".")[0]
        per_module[module] = per_module.get(module, 0) + numel
    return max(per_module.values(), default=0)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def write_report(probe: FirstStepProbe, strategy, model, step: int, run_dir: str, log, labels: dict) -> None:
    """All ranks: gather every rank's entry, then rank 0 logs one line and writes <run dir>/memory.json. `model`:
    the built model's facts (num_params, shapes, built_param_bytes: trainer/run/build.py ModelFacts); `labels`:
    {"strategy": ..., "precision": ...} as the config names them; `log`: one line to the run's log."""
    mine = dict(probe.report(), rank=dist.get_rank() if dist.is_initialized() else 0,
                built_params=model.built_param_bytes)
    ranks = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)  # every rank gets here, also when its measurements failed
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    world = len(ranks)
    result = {"world_size": world, "dp_size": strategy.dp_size, **labels, "num_params": model.num_params,
              "largest_layer_params": largest_layer_params(model.shapes), "step": step, "ranks": ranks}
    result.update(memory_layout(strategy))
    path = os.path.join(run_dir, "memory.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(result, fh, indent=1)
    os.replace(path + ".tmp", path)
    _log_summary(ranks, step, path, log)


def _log_summary(ranks: list, step: int, path: str, log) -> None:
    world = len(ranks)
    top = {c: max(r[c] for r in ranks) for c in (*CATEGORIES, "model_states")}
    errors = [f"rank {r['rank']}: {e}" for r in ranks for e in r["errors"]]
    if errors:
        log(f"warning: model-state memory not measured everywhere ({'; '.join(errors[:4])})")
    log(f"model-state memory per rank (MiB, max over {world} ranks, peaks in step {step}): "
        f"params {_mib(top['params'])} | grads {_mib(top['grads'])} | optimizer "
        f"{_mib(top['optimizer'])} | fp32 master {_mib(top['master_params'])} | model states "
        f"{_mib(top['model_states'])} | gathered params {_mib(top['gathered'])} | activations "
        f"{_mib(max(r.get('activations', 0) for r in ranks))} -> {path}")
