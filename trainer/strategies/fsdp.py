"""FSDP2 (`fully_shard`): `fsdp` shards over every data-parallel rank, `hsdp` replicates across
`strategy.dp_replicate` groups and shards within each group of `strategy.dp_shard` ranks.

Each decoder block and then the root are wrapped. The model is built with its parameters on the meta device
(buffers real), sharded, materialized shard by shard, and filled: seeded preset weights one block at a time,
or pretrained weights of which each rank reads only the rows it owns. No rank ever holds the whole model.

Numbers: gradients are *summed* over the data-parallel ranks (FSDP's default divides by the data-parallel
size, and on gloo, pytorch/pytorch#162338, may not): each rank's loss is already its share of the global
token-normalized loss, so the sum is the global batch's gradient. Sum-only reductions are forced, so the
result is the same on gloo and NCCL.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from trainer.strategies.base import Strategy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class FSDPStrategy(Strategy):
    name = "fsdp"
    names = ("fsdp", "hsdp")
    degrees = frozenset({"dp_replicate", "dp_shard"})
    supports_compile = True
    uses_fsdp_options = True

    @classmethod
    def config_problems(cls, cfg, world_size: int) -> List[str]:
        problems = super().config_problems(cfg, world_size)
        s = cfg.strategy
        if s.name == "fsdp" and s.dp_replicate not in (1,):
            problems.append(f"strategy=fsdp shards over every rank: strategy.dp_replicate must be 1 (got "
                            f"{s.dp_replicate}); for replicated shard groups use strategy=hsdp")
        for key, allowed in (("param_dtype", DTYPES), ("reduce_dtype", ("fp32", "bf16"))):
            value = getattr(s, key)
            if value is not None and value not in allowed:
                problems.append(f"strategy.{key}={value!r} is not one of null, {', '.join(allowed)}")
        for key in ("offload_optimizer", "offload_param"):
            if getattr(s, key) != "none":
                problems.append(f"strategy.{key}={getattr(s, key)} is a DeepSpeed option; FSDP offloads "
                                f"parameters, gradients and optimizer state together: set strategy.cpu_offload=true "
                                f"and strategy.{key}=none")
        if s.deepspeed_config:
            problems.append(f"strategy.deepspeed_config is a DeepSpeed option; strategy={s.name} does not read it")
        if s.cpu_offload and cfg.precision.name == "fp16":
            problems.append("strategy.cpu_offload=true with precision=fp16 is not supported (the loss scaler's "
                            "unscale runs on the accelerator); use precision=bf16")
        if s.param_dtype == "fp16" and cfg.precision.name != "fp16":
            problems.append(f"strategy.param_dtype=fp16 needs loss scaling: use precision=fp16 (got "
                            f"precision={cfg.precision.name}) or strategy.param_dtype=bf16")
        return problems

    def __init__(self, cfg, dims, device, precision):
        super().__init__(cfg, dims, device, precision)
        s = cfg.strategy
        self.param_dtype = DTYPES[s.param_dtype] if s.param_dtype else PRECISION_DTYPES[cfg.precision.name]
        self.reduce_dtype = DTYPES[s.reduce_dtype or "fp32"]
        # FSDP casts the gathered parameters itself: no autocast on top (fp16 keeps its loss scaler).
        precision.autocast_dtype = None
        if precision.scaler is not None:
            p = cfg.precision
            precision.scaler = ScalarFoundInfScaler(device.type, init_scale=p.init_scale,
                                                    growth_factor=p.growth_factor, backoff_factor=p.backoff_factor,
                                                    growth_interval=p.growth_interval, process_group=None)

    # ---- construction: parameters on the meta device, buffers real ----------------------------------------
    loads_pretrained_weights = True  # pretrained weights come to load_initial_weights, read shard by shard

    def model_construction(self, pretrained: bool):
        from accelerate import init_empty_weights

        return init_empty_weights(include_buffers=False)

    def _dp_mesh(self):
        mesh = self.dims.build_mesh(self.device.type)
        if self.cfg.strategy.name == "hsdp":
            return mesh["dp_replicate", "dp_shard"]
        return mesh["dp_shard"] if self.dims.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]

    def setup(self, model, build_optimizer, initial_weights=None):
        from models.init import decoder_blocks

        self.mesh = self._dp_mesh()
        self.fully_shard([b for _, b in decoder_blocks(model)], model, self.mesh)
        self.materialize(model)
        self.load_initial_weights(model, initial_weights)
        self.model = model
        self.optimizer = build_optimizer(model.named_parameters())
        return self.model, self.optimizer

    def fully_shard(self, blocks, root, mesh) -> None:
        """fully_shard each block, then the root, over `mesh` (1-D: fsdp; 2-D replicate x shard: hsdp), with
        the mixed-precision and offload policies; gradients summed."""
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        s = self.cfg.strategy
        options = dict(
            mesh=mesh, reshard_after_forward=s.reshard_after_forward,
            mp_policy=MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype),
            offload_policy=CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if s.cpu_offload
            else OffloadPolicy())
        for block in blocks:
            fully_shard(block, **options)
        fully_shard(root, **options)
        for module in root.modules():
            if isinstance(module, FSDPModule):
                # Sum, never average: see the module docstring.
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(1.0)

    def materialize(self, model) -> None:
        """Allocate this rank's shards of the meta parameters (uninitialized), keeping the buffers built on the
        host; with CPU offload the parameters stay on the host and the buffers go to the device."""
        offload = self.cfg.strategy.cpu_offload
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        model.to_empty(device="cpu" if offload else self.device)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        if offload:
            for module in model.modules():  # buffers are not FSDP's: they compute on the device
                for key, b in list(module._buffers.items()):
                    if b is not None:
                        module._buffers[key] = b.to(self.device)

    @torch.no_grad()
    def load_initial_weights(self, model, initial_weights) -> None:
        from models.init import named_tensors

        targets = named_tensors(model)
        if initial_weights is None:
            return
        if hasattr(initial_weights, "read"):  # a pretrained checkpoint: each rank reads its rows
            missing = initial_weights.missing(n for n, t in model.named_parameters())
            if missing:
                from trainer.errors import ModelError

                raise ModelError(f"model.name_or_path: the checkpoint in {initial_weights.folder} lacks "
                                 f"{len(missing)} of the model's parameters ({', '.join(missing[:4])} ...)")
            for name, target in targets.items():
                if initial_weights.key(name) is None:
                    continue  # a buffer the checkpoint does not hold: as built
                _write(target, lambda index, n=name: initial_weights.read(n, index))
            initial_weights.close()
            return
        for values in initial_weights:  # seeded: one block of full tensors at a time
            for name, value in values.items():
                if name in targets:  # (pipeline stages hold only some of the model)
                    _write(targets[name], lambda index, v=value: v[index] if index is not None else v)

    # ---- one step ---------------------------------------------------------------------------------------------
    def grad_norm_and_clip(self, max_norm: float) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # the norm of the whole gradient, from every rank's shard
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # ---- export: one parameter gathered at a time ---------------------------------------------------------
    def export_hf(self, out_dir: str, tokenizer) -> None:
        from trainer.strategies.base import write_hf_folder_streaming

        write_hf_folder_streaming(self.model.config, tokenizer, out_dir, self._full_tensors(), dist.get_rank() == 0)
        dist.barrier()

    def _full_tensors(self):
        from torch.distributed.tensor import DTensor

        param_names = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        for name, p in self.model.named_parameters():
            yield name, p.full_tensor() if isinstance(p, DTensor) else p
        for name, tensor in self.model.state_dict().items():  # persistent buffers
            if name not in param_names:
                yield name, tensor


def _write(target: torch.Tensor, read) -> None:
    """Copy this rank's part of a full tensor into `target` (a DTensor shard, on any mesh and placements, or a
    plain tensor); `read(index)` returns the full tensor's block at a tuple of slices (None: all of it)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(target, DTensor):
        target.copy_(read(None))
        return
    local = target.to_local()
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if local.numel() == 0 or 0 in shape:
        return
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape)) if target.dim() else None
    local.copy_(read(index).reshape(local.shape))


class ScalarFoundInfScaler(ShardedGradScaler):
    """ShardedGradScaler with its found-inf flags 0-d, as torch.amp.GradScaler keeps them: it makes them shape
    (1,), and torch's fused optimizers subtract the flag from their 0-d step counters in place, which fails
    ("output with shape [] doesn't match the broadcast shape [1]")."""

    def unscale_(self, optimizer) -> None:
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {d: f.reshape(()) for d, f in state["found_inf_per_device"].items()}
