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
FSDP2 adds `forward` and `backward`, taken at every FSDP module in the first micro-batch (see `_watch_fsdp`):
its gathered parameters exist only there. `log_memory` gathers the per-category peaks over all snapshots from
every rank, logs one line on rank 0 and writes `<run dir>/memory.json`; each rank's entry also has
`built_params`, the parameter bytes it held right after model construction (ZeRO-3 and FSDP: its partition, not
the whole model; FSDP builds on the meta device, so 0).
"""
from __future__ import annotations

import dataclasses
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


class _Tally:
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
# What each strategy holds
# ---------------------------------------------------------------------------------------------------------------
def _unique_params(module) -> list:
    return list(module.parameters()) if module is not None else []


def _optimizer_state(tally: _Tally, optimizer, label: str = "optimizer.state") -> None:
    if optimizer is None:
        return
    for state in getattr(optimizer, "state", {}).values():
        if isinstance(state, dict):
            for k, v in state.items():
                tally.add_all("optimizer", v, f"{label}.{k}")


def _measure_plain(strategy, tally: _Tally) -> None:
    params = _unique_params(strategy.unwrapped())
    for p in params:
        tally.add("params", p, "parameters")
    _optimizer_state(tally, strategy.optimizer)
    for p in params:
        tally.add("grads", p.grad, "param.grad")


def _is_zero3(zo) -> bool:
    return hasattr(zo, "fp32_partitioned_groups_flat")


def _ipg_buffers(zo) -> list:
    out = []
    for bucket in (getattr(zo, "ipg_buckets", None) or {}).values():
        buf = getattr(bucket, "buffer", None)
        out += list(buf) if isinstance(buf, (list, tuple)) else [buf]
    return [b for b in out if isinstance(b, torch.Tensor)]


def _measure_deepspeed(engine, tally: _Tally) -> None:
    zo = engine.optimizer
    params = _unique_params(engine.module)
    # Parameters: the bit16 flat buffers (ZeRO-1/2: the parameters are views into them) or this rank's
    # partitions (ZeRO-3: p.ds_tensor in lp_param_buffer; p.data is empty unless the parameter is whole).
    for p in params:
        tally.add("params", p, "parameters")
        tally.add("params", getattr(p, "ds_tensor", None), "ds_tensor partitions")
    for name in ("bit16_groups_flat", "lp_param_buffer", "fp16_partitioned_groups_flat",
                 "param_groups_fp16_flat_cpu_memory"):
        tally.add_all("params", getattr(zo, name, None), name)
    # ZeRO-1/2 offload: a bit16 staging copy of the partition on the CPU.
    tally.add_all("buffers", getattr(zo, "param_buffer_of_bit16_for_cpu_offload_groups", None),
                  "param_buffer_of_bit16_for_cpu_offload_groups")
    # fp32 masters. Where they are the parameters' own storage (ZeRO-3 means to alias them in fp32, but its check
    # compares a torch.device to a string and so makes a copy anyway) they were counted as params above.
    masters = getattr(zo, "single_partition_of_fp32_groups", None)
    if masters is None:
        masters = getattr(zo, "fp32_partitioned_groups_flat", None)
        master_name = "fp32_partitioned_groups_flat"
    else:
        master_name = "single_partition_of_fp32_groups"
    tally.add_all("master_params", masters, master_name)
    # Optimizer state: the client optimizer ZeRO steps on its fp32 partitions.
    inner = getattr(zo, "optimizer", None)
    _optimizer_state(tally, inner)
    if getattr(zo, "backup_optimizer", None) is not None:
        _optimizer_state(tally, zo.backup_optimizer, "backup_optimizer.state")
    # Reduction buckets: registered first so that gradient views into them are told apart from the rest.
    for buf in _ipg_buffers(zo):
        tally.share(buf, "ipg_buckets")
    for p in params:
        tally.add("grads", p.grad, "param.grad (bit16)")
        tally.add("grads", getattr(p, "grad_accum", None), "param.grad_accum")
    for m in masters or []:
        tally.add("grads", getattr(m, "grad", None), "fp32 partition .grad")
    grad_attrs = ["averaged_gradients", "all_grad_tensors", "grads_in_partition", "grad_partitions_flat_buffer",
                  "temp_grad_buffer_for_cpu_offload", "temp_grad_buffer_for_gpu_offload", "accumulated_grads_in_cpu",
                  "offload_gradient_dict"]
    for name in grad_attrs:
        tally.add_all("grads", getattr(zo, name, None), name)
    # Anything else the ZeRO optimizer holds (found by walking it), classified by its attribute's name.
    for path, t in _walk(zo):
        low = path.lower()
        if "grad" in low and "norm" not in low:  # not _global_grad_norm, a scalar
            category = "grads"
        elif "ipg" in low or "bucket" in low:
            category = "buffers"
        elif "fp32" in low:
            category = "master_params"
        elif "bit16" in low or "fp16" in low or "bf16" in low or "lp_param" in low:
            category = "params"
        else:
            category = "other"
        tally.add(category, t, path.split(".")[0].split("[")[0])


_SKIP_ATTRS = {"optimizer", "backup_optimizer", "module", "_module", "timers", "loss_scaler"}


def _walk(obj, path: str = "", depth: int = 0, visited=None):
    """(attribute path, tensor) for tensors reachable from a DeepSpeed object's attributes: lists, tuples,
    dicts and DeepSpeed-defined objects / dataclasses are entered; modules and optimizers are not."""
    if visited is None:
        visited = set()
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if depth > 5 or id(obj) in visited or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        return
    visited.add(id(obj))
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield from _walk(v, f"{path}[{k!r}]" if isinstance(k, (str, int)) else f"{path}[]", depth + 1, visited)
    elif isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(list(obj)):
            yield from _walk(v, f"{path}[{i}]", depth + 1, visited)
    elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith("deepspeed"):
        for k, v in list(getattr(obj, "__dict__", {}).items()):
            if depth == 0 and k in _SKIP_ATTRS:
                continue
            yield from _walk(v, f"{path}.{k}" if path else k, depth + 1, visited)


def _fsdp_trees(strategy) -> list:
    """[(root, [FSDP2 modules in its tree, root first])] for the strategy's module trees that contain FSDP2
    (`fully_shard`) modules: the pipeline stage modules a strategy keeps apart from its model (`stage_modules`;
    FSDP's root there is the stage module, which the model's tree does not contain), then the model. Each FSDP
    module once, in the first tree that holds it."""
    roots = [*(getattr(strategy, "stage_modules", None) or {}).values(), strategy.unwrapped()]
    trees, seen = [], set()
    for root in roots:
        found = []
        for m in root.modules() if isinstance(root, torch.nn.Module) else []:
            if id(m) not in seen and hasattr(m, "_get_fsdp_state"):
                seen.add(id(m))
                found.append(m)
        if found:
            trees.append((root, found))
    return trees


def _fsdp_modules(strategy) -> list:
    return [m for _, found in _fsdp_trees(strategy) for m in found]


def _fsdp_states(strategy) -> list:
    """The FSDP2 states of the strategy's modules, each once; [] without FSDP2. A state owns the parameter groups
    of its module (`_fsdp_param_groups`; one `_fsdp_param_group` in older torch) and shares one communication
    context with the others."""
    states, seen = [], set()
    for m in _fsdp_modules(strategy):
        try:
            state = m._get_fsdp_state()
        except Exception:  # noqa: BLE001, S112 - not an FSDP2 module after all
            continue
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    return states


def _fsdp_params(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [(g, fp) for g in groups if g is not None for fp in getattr(g, "fsdp_params", [])]


def _measure_fsdp(strategy, states, tally: _Tally) -> None:
    """FSDP2: each parameter is a DTensor whose local shard is this rank's part of the fp32 parameter (also the
    master copy: with a MixedPrecisionPolicy FSDP casts what it all-gathers, and keeps no other copy); gradients
    and AdamW state are DTensor shards too. While a group is unsharded (forward / backward) its module holds the
    all-gathered parameters instead (bf16 under precision=bf16): they are counted as `gathered`, and the shards,
    found through FSDP's own records, still as params."""
    pairs = [pair for state in states for pair in _fsdp_params(state)]
    for _, fp in pairs:
        tally.add("params", getattr(fp, "sharded_param", None), "sharded parameters (DTensor local shards)")
    for _, fp in pairs:
        for t in list(getattr(fp, "all_gather_outputs", None) or []) + \
                list(getattr(fp, "_unsharded_inner_tensors", None) or []):
            tally.add("gathered", t, "all-gathered parameters")
        tally.add("gathered", getattr(fp, "_sharded_post_forward_param_data", None), "post-forward reshard (hsdp)")
    model = strategy.unwrapped()
    for p in _unique_params(model):  # parameters FSDP does not manage; nothing new while all are sharded
        tally.add("params", p, "parameters")
    _optimizer_state(tally, strategy.optimizer)
    for _, fp in pairs:
        sharded = getattr(fp, "sharded_param", None)
        tally.add("grads", getattr(sharded, "grad", None), "sharded gradients (DTensor local shards)")
        unsharded = getattr(fp, "_unsharded_param", None)
        tally.add("grads", getattr(unsharded, "grad", None), "unsharded gradients (backward)")
        tally.add("grads", getattr(fp, "unsharded_accumulated_grad", None), "unsharded accumulated gradients")
    for p in _unique_params(model):
        tally.add("grads", p.grad, "param.grad")
    # Communication buffers: the flat all-gather output, the reduce-scatter input kept for the next wait,
    # a partial reduce output (gradient accumulation without reduce-scatter).
    seen_ctx = set()
    for state in states:
        ctx = getattr(state, "_comm_ctx", None)
        if ctx is not None and id(ctx) not in seen_ctx:
            seen_ctx.add(id(ctx))
            tally.add_all("buffers", getattr(ctx, "all_gather_state", None), "all-gather state")
            tally.add_all("buffers", getattr(ctx, "reduce_scatter_states", None), "reduce-scatter inputs")
    for state in states:
        groups = {id(g): g for g, _ in _fsdp_params(state)}
        for g in groups.values():
            tally.add("grads", getattr(g, "_partial_reduce_output", None), "partial reduce output")
            tally.add_all("buffers", getattr(g, "_all_gather_result", None), "all-gather output")
            tally.add("buffers", getattr(g, "_all_gather_output", None), "all-gather output")
            tally.add_all("buffers", getattr(g, "_all_reduce_state", None), "all-reduce input (hsdp)")


def measure_model_states(strategy) -> dict:
    """This rank's bytes now: {"params", "grads", "optimizer", "master_params", "gathered", "buffers", "other",
    "total", "detail": {category: {label: bytes}}}. Call it after an optimizer step (before it there is no optimizer
    state); gradients exist only between backward and the end of the step (see the module's docstring)."""
    tally = _Tally()
    engine = getattr(strategy, "engine", None)
    states = [] if engine is not None else _fsdp_states(strategy)
    if engine is not None and getattr(engine, "optimizer", None) is not None:
        _measure_deepspeed(engine, tally)
    elif states:
        _measure_fsdp(strategy, states, tally)
    else:
        _measure_plain(strategy, tally)
    return tally.result()


def parameter_bytes(module) -> int:
    """Bytes of the parameters this rank holds now: ZeRO-3 partitions, DTensor shards, nothing for meta
    tensors. Measured right after model construction, it shows whether a rank ever held the whole model."""
    tally = _Tally()
    for p in _unique_params(module):
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
    engine = getattr(strategy, "engine", None)
    zo = getattr(engine, "optimizer", None) if engine is not None else None
    if zo is not None and hasattr(zo, "independent_gradient_partition_epilogue"):
        original = zo.independent_gradient_partition_epilogue  # the bound method

        def epilogue(*args, **kwargs):  # all of this step's gradients are produced, not yet reduced away
            probe.snap("backward_end")
            return original(*args, **kwargs)

        zo.independent_gradient_partition_epilogue = epilogue  # an instance attribute shadows the method
        probe.undo.append(lambda: zo.__dict__.pop("independent_gradient_partition_epilogue", None))
    if engine is None:
        for root, modules in _fsdp_trees(strategy):
            _watch_fsdp(probe, root, modules)
    _PROBES[strategy] = probe
    return True


def _first_grad_tensor(output):
    """The first tensor in a module's output (tensor, tuple / list, dict / ModelOutput) that requires grad."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for v in values:
        t = _first_grad_tensor(v)
        if t is not None:
            return t
    return None


def _watch_fsdp(probe: _Probe, root, modules: list) -> None:
    """FSDP2: the gathered (unsharded) parameters exist only in forward and backward. During the first
    micro-batch: `forward` at every FSDP module's forward, after FSDP's own pre-forward hook gathered its
    parameters (and before resharding: reshard_after_forward=true frees a block's after its forward, false keeps
    every block's until its backward); `backward` when the gradient reaches the module's output, after FSDP's
    pre-backward hook (registered on the same output earlier, so it runs first) gathered the parameters again and
    prefetched the next block's (still in that block's flat all-gather output, counted as buffers, until its own
    pre-backward copies it out); the gradient shards of the blocks behind it exist by then, and the root's
    unsharded gradients (it reduce-scatters them only at the end of backward). Not seen: a block's unsharded
    gradients between its backward and their reduce-scatter."""
    forwards = [0]

    def count(module, args):
        forwards[0] += 1

    def pre(module, args):
        if forwards[0] == 1:
            probe.snap("forward")

    def post(module, args, output):
        if forwards[0] != 1 or not torch.is_grad_enabled():
            return
        t = _first_grad_tensor(output)
        if t is not None:
            t.register_hook(lambda grad: probe.snap("backward"))  # returns None: the gradient is unchanged

    handles = [root.register_forward_pre_hook(count, prepend=True)]  # counts the root's forwards (micro-batches)
    for m in modules:  # appended: they run after FSDP's pre-forward (prepended) and post-forward hooks
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    probe.undo += [h.remove for h in handles]


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


def _fsdp_layout(strategy) -> Optional[dict]:
    """FSDP2 only: the shard group's size and each FSDP module's parameter count (unsharded; the root's first),
    what the gathered parameters of a module cost."""
    units, shard_size = [], None
    for state in _fsdp_states(strategy):
        pairs = _fsdp_params(state)
        if not pairs:
            continue
        units.append(sum(fp.sharded_param.numel() for _, fp in pairs))
        mesh_info = getattr(pairs[0][0], "mesh_info", None)
        shard_size = getattr(mesh_info, "shard_mesh_size", shard_size)
    if not units:
        return None
    return {"shard_size": shard_size, "unit_params": units}


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
        layout = _fsdp_layout(strategy)
        if layout is not None:
            result["fsdp"] = layout
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
