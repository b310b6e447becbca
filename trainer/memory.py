"""Per-rank memory of the model states, measured from the live tensors (never computed from formulas).

`measure_model_states(strategy)` walks what this rank holds right now and returns bytes per category:

* params: the model's parameters as they are stored (DeepSpeed: the bf16/fp16 flat buffers the parameters are
  views into; ZeRO-3: this rank's partitions `p.ds_tensor` plus any parameter that is whole, such as the
  persistent small ones below `stage3_param_persistence_threshold`; FSDP2: the local shards of the DTensor
  parameters, fp32, padded as FSDP pads them);
* master_params: fp32 master copies, where the strategy keeps them apart from the parameters (ZeRO's
  `single_partition_of_fp32_groups` / `fp32_partitioned_groups_flat`, also in fp32 training; none for
  single/ddp, whose parameters are fp32 themselves, nor for FSDP2, whose fp32 shards are the parameters: its
  MixedPrecisionPolicy casts what it all-gathers);
* optimizer: the tensors in the optimizer's `state` (AdamW: exp_avg, exp_avg_sq and the `step` scalars; FSDP2:
  DTensor shards, counted by their local tensors);
* grads: gradients wherever they live: `.grad` of the parameters and of the fp32 partitions, ZeRO's gradient
  partitions (`averaged_gradients`, `grads_in_partition`, ZeRO-3's `grad_partitions_flat_buffer`) and the
  parts of the communication buckets that gradients occupy; FSDP2: the sharded gradients (DTensor `.grad` of
  the sharded parameters, views into one reduce-scatter output per FSDP module) and, in backward, the unsharded
  gradients of gathered parameters;
* gathered: FSDP2's all-gathered (unsharded) parameters, the compute copies (bf16 under precision=bf16) that
  exist only between a module's all-gather and its reshard; not a model state;
* buffers: the rest of ZeRO's reduction buckets (`ipg_buckets`, `reduce_bucket_size` elements each, allocated
  whether or not gradients fill them); FSDP2's communication buffers (flat all-gather outputs: the last one, kept
  until the next all-gather, and a prefetched block's before it is copied out into its parameters; the
  reduce-scatter input; HSDP's all-reduce input);
* other: any other tensor found in the ZeRO optimizer object.

Each distinct storage is counted once (keyed by `untyped_storage().data_ptr()`, counted as the storage's
`nbytes()`), in the category met first in the order above; a gradient that is a view into a bucket counts its
own bytes as gradient bytes, the bucket's remainder counts as buffers. `total` is the sum of all categories.

Gradients are transient: every strategy frees them in or after the optimizer step (single/ddp/FSDP:
`zero_grad(set_to_none=True)`; ZeRO-1/2: its buckets and partitions are released in the step; ZeRO-3 keeps
only its flat gradient-partition buffer). So the trainer measures at several points of the first step
(`watch_first_step`, armed before the loop): at the end of backward (DeepSpeed: entry of the gradient epilogue,
when the buckets hold this step's gradients), inside the optimizer step (a post-hook of the torch optimizer:
gradients and the new optimizer state both exist; ZeRO steps it once per parameter group), and after the step.
FSDP2 adds `forward` and `backward`, taken at every FSDP module in the first micro-batch: its gathered
parameters exist only there. `log_memory` gathers the per-category peaks over all snapshots from
every rank, logs one line on rank 0 and writes `<run dir>/memory.json`; each rank's entry also has
`built_params`, the parameter bytes it held right after model construction (ZeRO-3 and FSDP: its partition, not
the whole model; FSDP builds on the meta device, so 0).

This module counts and logs; where a backend keeps its tensors is the strategy's own knowledge: each strategy
adds them (`Strategy.count_model_states`), arms its own probe points (`Strategy.watch_memory`) and may add a
layout entry to memory.json (`Strategy.memory_layout`). The ZeRO and FSDP2 specifics are in
trainer/strategies/deepspeed.py and trainer/strategies/fsdp.py.
"""
from __future__ import annotations

import json
import os
import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

CATEGORIES = ("params", "master_params", "optimizer", "grads", "gathered", "buffers", "other")
MODEL_STATES = ("params", "grads", "optimizer", "master_params")  # what the ZeRO paper's formulas count


# ---------------------------------------------------------------------------------------------------------------
# Counting storages
# ---------------------------------------------------------------------------------------------------------------
def _storage(t: torch.Tensor):
    """(key, nbytes) of the tensor's storage, or (None, 0) for meta / empty storages. A DTensor counts its local
    shard."""
    local = getattr(t, "_local_tensor", None)  # a DTensor: its shard (to_local() without an autograd node)
    if isinstance(local, torch.Tensor):
        t = local
    elif hasattr(t, "to_local"):
        t = t.to_local()
    if t.device.type == "meta":
        return None, 0
    s = t.untyped_storage()
    if s.nbytes() == 0 or s.data_ptr() == 0:
        return None, 0
    return (t.device.type, t.device.index, s.data_ptr()), s.nbytes()


def _union_length(ranges) -> int:
    total, end = 0, -1
    for a, b in sorted(ranges):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class Tally:
    """Bytes per category, each storage counted once; `shared` storages (communication buckets) are split into
    the bytes that gradient views occupy and the rest."""

    def __init__(self):
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.detail: Dict[str, Dict[str, int]] = {c: {} for c in CATEGORIES}
        self.seen = set()
        self.shared = {}  # key -> {"nbytes", "label", "ranges", "grad_labels"}

    def _note(self, category: str, label: str, nbytes: int) -> None:
        self.bytes[category] += nbytes
        self.detail[category][label] = self.detail[category].get(label, 0) + nbytes

    def share(self, t, label: str) -> None:
        if not isinstance(t, torch.Tensor):
            return
        key, nbytes = _storage(t)
        if key is None or key in self.seen or key in self.shared:
            return
        self.shared[key] = {"nbytes": nbytes, "label": label, "ranges": [], "grad_labels": set()}

    def add(self, category: str, t, label: str) -> None:
        if not isinstance(t, torch.Tensor):
            return
        key, nbytes = _storage(t)
        if key is None or key in self.seen:
            return
        if key in self.shared:
            if category == "grads":  # a gradient living in a bucket: its own bytes are gradient bytes
                start = t.storage_offset() * t.element_size()
                self.shared[key]["ranges"].append((start, start + t.numel() * t.element_size()))
                self.shared[key]["grad_labels"].add(label)
            return
        self.seen.add(key)
        self._note(category, label, nbytes)

    def add_all(self, category: str, obj, label: str) -> None:
        """Tensors in nested lists / tuples / dicts (values) / objects with a `flat_partition`."""
        for t in _tensors_in(obj):
            self.add(category, t, label)

    def result(self) -> dict:
        for key, s in self.shared.items():
            used = min(_union_length(s["ranges"]), s["nbytes"])
            if used:
                self._note("grads", f"{s['label']} (gradient views)", used)
            self._note("buffers", s["label"], s["nbytes"] - used)
            self.seen.add(key)
        out = dict(self.bytes)
        out["total"] = sum(self.bytes.values())
        out["detail"] = {c: d for c, d in self.detail.items() if d}
        return out


def _tensors_in(obj, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 4 or obj is None:
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        if getattr(obj, "flat_partition", None) is not None:  # ZeRO's GradPartitionBufferGroup
            yield obj.flat_partition
        for v in obj:
            yield from _tensors_in(v, depth + 1)


# ---------------------------------------------------------------------------------------------------------------
# What a rank holds: each strategy adds its own tensors (Strategy.count_model_states); these are the common parts
# ---------------------------------------------------------------------------------------------------------------
def unique_params(module) -> list:
    return list(module.parameters()) if module is not None else []


def count_optimizer_state(tally: Tally, optimizer, label: str = "optimizer.state") -> None:
    """The tensors in a torch optimizer's `state` (AdamW: exp_avg, exp_avg_sq, step), as optimizer bytes."""
    if optimizer is None:
        return
    for state in getattr(optimizer, "state", {}).values():
        if isinstance(state, dict):
            for k, v in state.items():
                tally.add_all("optimizer", v, f"{label}.{k}")


def count_plain(tally: Tally, module, optimizer) -> None:
    """A model whose parameters are whole (or plain shards) and a torch optimizer over them: single, ddp, tp."""
    params = unique_params(module)
    for p in params:
        tally.add("params", p, "parameters")
    count_optimizer_state(tally, optimizer)
    for p in params:
        tally.add("grads", p.grad, "param.grad")


def measure_model_states(strategy) -> dict:
    """This rank's bytes now: {"params", "grads", "optimizer", "master_params", "gathered", "buffers", "other",
    "total", "detail": {category: {label: bytes}}}. Call it after an optimizer step (before it there is no optimizer
    state); gradients exist only between backward and the end of the step (see the module's docstring)."""
    tally = Tally()
    strategy.count_model_states(tally)
    return tally.result()


def parameter_bytes(module) -> int:
    """Bytes of the parameters this rank holds now: ZeRO-3 partitions, DTensor shards, nothing for meta
    tensors. Measured right after model construction, it shows whether a rank ever held the whole model."""
    tally = Tally()
    for p in unique_params(module):
        tally.add("params", getattr(p, "ds_tensor", None), "ds_tensor partitions")
        tally.add("params", p, "parameters")
    return tally.bytes["params"]


def gather_memory(strategy, mine: Optional[dict] = None) -> List[dict]:
    """Every rank's dict (default: `measure_model_states(strategy)`), on every rank; [mine] without a process
    group. A collective: all ranks must call it."""
    mine = measure_model_states(strategy) if mine is None else mine
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Probing the first step and logging it
# ---------------------------------------------------------------------------------------------------------------
class _Probe:
    """Snapshots taken at named points of one step: per point, the one with the largest total (a consistent
    picture of one moment); and per category, the largest figure over every snapshot and the point it was taken
    at (a point may be visited many times: FSDP's `forward` / `backward` once per module)."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.snapshots: Dict[str, dict] = {}
        self.peaks: Dict[str, int] = {}
        self.peak_point: Dict[str, str] = {}
        self.errors: List[str] = []
        self.undo = []

    def snap(self, point: str) -> None:
        try:  # runs inside the optimizer step: a failure to measure must never fail training
            m = measure_model_states(self.strategy)
        except Exception as e:
            self.errors.append(f"{point}: {type(e).__name__}: {e}")
            return
        if point not in self.snapshots or m["total"] > self.snapshots[point]["total"]:
            self.snapshots[point] = m
        for c in CATEGORIES:
            if c not in self.peaks or m[c] > self.peaks[c]:
                self.peaks[c], self.peak_point[c] = m[c], point

    def close(self) -> None:
        for undo in self.undo:
            undo()
        self.undo = []


_PROBES = weakref.WeakKeyDictionary()


def watch_first_step(run) -> bool:
    """Arm the probes for the next optimizer step (the loop calls `log_memory` after it). Returns True."""
    strategy = run.strategy
    probe = _Probe(strategy)
    optimizer = strategy.optimizer  # DeepSpeed: the client optimizer that ZeRO steps on its fp32 partitions
    if optimizer is not None and hasattr(optimizer, "register_step_post_hook"):
        handle = optimizer.register_step_post_hook(lambda *_: probe.snap("optimizer_step"))
        probe.undo.append(handle.remove)
    probe.undo += strategy.watch_memory(probe.snap)  # the strategy's own points (end of backward, FSDP gathers)
    _PROBES[strategy] = probe
    return True


def _peaks(probe: _Probe) -> dict:
    """Per category, the largest figure over every snapshot of the probe; `model_states` = params + grads +
    optimizer + master_params of those peaks (what the ZeRO formulas count); `total` = the sum of all categories'
    peaks. The peaks of different categories may come from different moments."""
    out = {c: probe.peaks.get(c, 0) for c in CATEGORIES}
    out["model_states"] = sum(out[c] for c in MODEL_STATES)
    out["total"] = sum(out[c] for c in CATEGORIES)
    out["peak_point"] = dict(probe.peak_point)
    return out


def _largest_layer_params(module) -> int:
    """Parameters of the largest module (own parameters only), full sizes even when ZeRO-3 partitioned them."""
    largest = 0
    for m in module.modules():
        largest = max(largest, sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters(recurse=False)))
    return largest


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def log_memory(run) -> bool:
    """After the first step: gather every rank's model-state memory (peaks over the probe points, and each
    point's snapshot), log one line on rank 0 and write <run dir>/memory.json there. All ranks must call it.
    Returns False (the loop's `first` flag)."""
    strategy = run.strategy
    probe = _PROBES.pop(strategy, None) or _Probe(strategy)
    probe.close()
    probe.snap("after_step")
    mine = dict(_peaks(probe), rank=dist.get_rank() if dist.is_initialized() else 0,
                points=probe.snapshots, errors=probe.errors, built_params=run.built_param_bytes)
    ranks = gather_memory(strategy, mine)  # every rank gets here, also when its measurements failed
    if not dist.is_initialized() or dist.get_rank() == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        result = {"world_size": world, "dp_size": strategy.dp_size, "strategy": run.cfg.strategy.name,
                  "precision": run.cfg.precision.name, "num_params": run.num_params,
                  "largest_layer_params": _largest_layer_params(strategy.unwrapped()), "step": run.step,
                  "ranks": ranks}
        result.update(strategy.memory_layout())
        path = os.path.join(run.run_dir, "memory.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(result, fh, indent=1)
        os.replace(path + ".tmp", path)
        top = {c: max(r[c] for r in ranks) for c in (*CATEGORIES, "model_states")}
        errors = [f"rank {r['rank']}: {e}" for r in ranks for e in r["errors"]]
        if errors:
            run.logger.info(f"warning: model-state memory not measured everywhere ({'; '.join(errors[:4])})")
        run.logger.info(f"model-state memory per rank (MiB, max over {world} ranks, peaks in step {run.step}): "
                        f"params {_mib(top['params'])} | grads {_mib(top['grads'])} | optimizer "
                        f"{_mib(top['optimizer'])} | fp32 master {_mib(top['master_params'])} | model states "
                        f"{_mib(top['model_states'])} | gathered params {_mib(top['gathered'])} | buffers "
                        f"{_mib(top['buffers'])} | other {_mib(top['other'])} -> {path}")
    return False
