"""Tensor and pipeline parallelism and their hybrids with FSDP: `tp`, `pp`, `fsdp_tp` (2-D), `pp_fsdp` (2-D)
and `3d` (pp x fsdp x tp), over the mesh (pp, dp_replicate, dp_shard, tp) of the validated degrees.

Order, as in torchtitan: the model (parameters on the meta device) is cut into pipeline stages, each stage's
modules are split by the tensor-parallel plan of the model registry (DTensor), and each stage is sharded over
the data-parallel ranks with FSDP2 (when there are any); then shards are allocated and filled, one block of
seeded weights or one pretrained tensor's slice at a time.

Pipeline stages are the Hugging Face model itself with the other stages' blocks removed (the ModuleList keeps
its original indices, so parameter names are the full model's and checkpoints move between layouts), without
the embeddings (later stages take hidden states as `inputs_embeds`) or the final norm and head (earlier stages
return hidden states). The loss of each micro-batch is its token cross-entropy *sum* divided by the global
batch's target-token count and the schedule does not rescale gradients (`scale_grads=False`): accumulation
over micro-batches is then exactly the token-normalized global loss, never a mean of means
(pytorch/torchtitan#1733).
"""
from __future__ import annotations

import copy
from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.data.datasets import IGNORE
from trainer.strategies.base import to_device
from trainer.strategies.fsdp import FSDPStrategy, _write

SCHEDULES = {
    # name: (torch class name, stages per rank: 1, "v" (2, V-shaped) or None (strategy.pp_stages_per_rank))
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", None),
    "looped_bfs": ("ScheduleLoopedBFS", None),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", None),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}


def stages_per_rank(s) -> int:
    kind = SCHEDULES.get(s.pp_schedule, (None, 1))[1]
    if kind == "v":
        return 2
    return s.pp_stages_per_rank if kind is None else 1


def stage_indices(pp_rank: int, pp: int, per_rank: int, v_shape: bool) -> List[int]:
    """Stages a pipeline rank holds: looped (r, r + p, ...) or V-shaped (r and 2p - 1 - r)."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


class _ZeroPositions(nn.Module):
    """An additive position embedding on a later stage: the first stage added it already."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, position_ids):
        return torch.zeros(*position_ids.shape, self.dim, device=position_ids.device)


class StageModule(nn.Module):
    """One pipeline stage: input ids (first stage) or hidden states in, hidden states or logits out."""

    def __init__(self, lm: nn.Module, first: bool, last: bool):
        super().__init__()
        self.lm = lm
        self.first, self.last = first, last

    def forward(self, x):
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if self.last:
            return self.lm(**inputs, use_cache=False).logits
        # Earlier stages: the base model's hidden states (the causal LM would hand out a view of them, which
        # the zero-bubble schedules' backward can't detach in place).
        return getattr(self.lm, self.lm.base_model_prefix)(**inputs, use_cache=False).last_hidden_state


def _set_module(root: nn.Module, path: str, module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


class ModelParallelStrategy(FSDPStrategy):
    name = "tp"
    names = ("tp", "pp", "fsdp_tp", "pp_fsdp", "3d")
    degrees = frozenset({"dp_replicate", "dp_shard", "tp", "pp"})

    @classmethod
    def config_problems(cls, cfg, world_size: int) -> List[str]:
        problems = super().config_problems(cfg, world_size)
        s = cfg.strategy
        if s.pp_schedule not in SCHEDULES:
            problems.append(f"strategy.pp_schedule={s.pp_schedule!r} is not one of {', '.join(SCHEDULES)}")
        elif s.pp_stages_per_rank < 1:
            problems.append("strategy.pp_stages_per_rank must be >= 1")
        if cfg.train.compile and s.pp not in (1,):
            problems.append(f"train.compile=true is not supported with pipeline parallelism (strategy.pp={s.pp}); "
                            f"set train.compile=false")
        if s.cpu_offload:
            problems.append(f"strategy.cpu_offload=true is available with strategy=fsdp/hsdp only (got "
                            f"strategy={s.name}); set strategy.cpu_offload=false")
        return problems

    @classmethod
    def model_problems(cls, cfg, info, dims) -> List[str]:
        """Checks that need the model's shape and the degrees (called before any process group starts)."""
        from models import plans
        from models.init import meta_model
        from trainer import config as C

        s = cfg.strategy
        problems = []
        model = meta_model(info.hf_config)
        if dims.tp > 1:
            problems += plans.tp_plan_problems(info.hf_config.model_type, plans.tp_plan(model, dims.tp) is not None,
                                               info, dims.tp)
            if s.sequence_parallel and cfg.data.seq_len % dims.tp:
                problems.append(f"strategy.sequence_parallel=true splits data.seq_len={cfg.data.seq_len} over "
                                f"strategy.tp={dims.tp}: it must divide")
        if dims.pp > 1 and s.pp_schedule in SCHEDULES:
            if plans.pipeline_split(model) is None:
                problems.append(f"strategy.pp={dims.pp}: Tessera has no pipeline split for the "
                                f"{info.hf_config.model_type} architecture; set strategy.pp=1")
            if getattr(info.hf_config, "tie_word_embeddings", False):
                problems.append(f"strategy.pp={dims.pp} puts the embeddings and the LM head on different stages, "
                                f"but this model ties them (tie_word_embeddings); set strategy.pp=1 or "
                                f"model.tie_word_embeddings=false")
            n_stages = dims.pp * stages_per_rank(s)
            problems += plans.split_problems(info.num_layers, n_stages, s.pp_split_points)
            micro = C.grad_accumulation_steps(cfg, dims.dp_size) if dims.dp_size else 0
            kind = SCHEDULES[s.pp_schedule][1]
            need = dims.pp if kind == 1 and s.pp_schedule != "gpipe" else (n_stages if kind == "v" else 0)
            if micro and need and micro < need:
                problems.append(f"strategy.pp_schedule={s.pp_schedule} needs at least {need} micro-batches per step "
                                f"but train.global_batch_size / (train.micro_batch_size x data-parallel degree) "
                                f"gives {micro}; raise train.global_batch_size or lower train.micro_batch_size")
            if micro and kind is None:
                rounds = max(1, micro // dims.pp)
                if micro % rounds:
                    problems.append(f"strategy.pp_schedule={s.pp_schedule} needs the micro-batches per step "
                                    f"({micro}) to be a multiple of {rounds}; change train.global_batch_size")
        return problems

    # ---- building ------------------------------------------------------------------------------------------
    def setup(self, model, build_optimizer, initial_weights=None):
        from models import plans
        from models.init import decoder_blocks

        d, s = self.dims, self.cfg.strategy
        mesh = self.dims.build_mesh(self.device.type)
        self.world_mesh = mesh
        self.tp_mesh = mesh["tp"] if d.tp > 1 else None
        self.dp_mesh = mesh["dp_replicate", "dp_shard"] if d.dp_size > 1 else None
        self.pp_group = mesh["pp"].get_group() if d.pp > 1 else None
        self._dp_group = mesh["dp_replicate", "dp_shard"]._flatten().get_group() if d.dp_size > 1 else None
        self.pp_rank = mesh["pp"].get_local_rank() if d.pp > 1 else 0
        if self.dp_mesh is not None and d.dp_replicate == 1:
            self.dp_mesh = mesh["dp_shard"]

        self.split = plans.pipeline_split(model) if d.pp > 1 else None
        v_shape = SCHEDULES[s.pp_schedule][1] == "v"
        per_rank = stages_per_rank(s) if d.pp > 1 else 1
        self.num_stages = d.pp * per_rank
        self.my_stages = stage_indices(self.pp_rank, d.pp, per_rank, v_shape) if d.pp > 1 else [0]
        layer_ranges = plans.stage_layers(self.model_info_layers(model), self.num_stages, s.pp_split_points)
        self.parts = []  # (stage index, HF model holding that stage's modules)
        for stage in self.my_stages:
            part = model if len(self.my_stages) == 1 else copy.deepcopy(model)
            if d.pp > 1:
                self._cut(part, stage, layer_ranges[stage])
            self.parts.append((stage, part))
        # With pipeline stages, the stage module is the root that FSDP wraps (and the pipeline runs): its
        # forward may skip the causal LM's own.
        self.stage_modules = {stage: StageModule(part, stage == 0, stage == self.num_stages - 1)
                              for stage, part in self.parts} if d.pp > 1 else {}
        for stage, part in self.parts:
            root = self.stage_modules.get(stage, part)
            if d.tp > 1:
                self._apply_tp(part, plans.tp_plan(part, d.tp))
            if self.dp_mesh is not None:
                self.fully_shard([b for _, b in decoder_blocks(part)], root, self.dp_mesh)
            self.materialize(root)  # new parameter objects: hooks go on after it
            if d.tp > 1 and self.dp_mesh is None:  # FSDP2 brings its parameters' gradients to their layout itself
                _grads_in_param_layout(part)
        for _, part in self.parts:
            if initial_weights is not None and hasattr(initial_weights, "read"):
                self.load_initial_weights(part, initial_weights)
        if initial_weights is not None and not hasattr(initial_weights, "read"):
            self._load_seeded(initial_weights)
        self.state_model = self._state_view(model) if len(self.parts) > 1 else self.parts[0][1]
        self.model = self.state_model
        self.optimizer = build_optimizer(self.state_model.named_parameters())
        if d.pp > 1:
            self._build_schedule()
        return self.model, self.optimizer

    @staticmethod
    def model_info_layers(model) -> int:
        from models.init import decoder_blocks

        return len(decoder_blocks(model))

    def _cut(self, part, stage: int, layers: range) -> None:
        """Keep only this stage's blocks (original indices kept) and its end modules."""
        split = self.split
        blocks = part.get_submodule(split.layers)
        blocks._modules = {k: m for k, m in blocks._modules.items() if int(k) in layers}
        if stage != 0:
            for path in split.first:
                if path in split.zeroed_on_later_stages:
                    _set_module(part, path, _ZeroPositions(part.get_submodule(path).embedding_dim))
                else:
                    _set_module(part, path, None)
        if stage != self.num_stages - 1:
            for path in split.last:
                _set_module(part, path, nn.Identity())

    def _apply_tp(self, part, plan) -> None:
        import re

        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                       RowwiseParallel, SequenceParallel, parallelize_module)

        from models.init import decoder_blocks

        sp = self.cfg.strategy.sequence_parallel
        styles = {
            # Sequence parallelism: outside attention and MLP the activations stay split over the sequence
            # (dim 1); the modules holding column-parallel projections gather it at their input (Hugging Face's
            # attention takes its shapes from its input), the row-parallel outputs reduce-scatter it.
            "colwise": lambda: ColwiseParallel(),
            "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
            "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        }
        names = [n for n, m in part.named_modules() if n and not isinstance(m, nn.Identity) and m is not None]
        resolved = {}
        for pattern, style in plan.items():
            if style not in styles:
                from trainer.errors import ModelError

                raise ModelError(f"the model's tensor-parallel plan uses style {style!r} for {pattern!r}, which Tessera "
                                 f"does not apply (supported: {', '.join(styles)}); set strategy.tp=1")
            regex = pattern.replace(".", r"\.").replace("*", r"\d+")
            for n in names:
                if re.fullmatch(regex, n):  # `*` stands for a layer index
                    resolved[n] = styles[style]()
        if sp:
            gather_at = {n.rpartition(".")[0] for n, st in resolved.items() if isinstance(st, ColwiseParallel)}
            gather_at = {n for n in gather_at if n and any(n.startswith(b + ".") for b, _ in decoder_blocks(part))}
            for n in gather_at:
                part.get_submodule(n).register_forward_pre_hook(self._gather_sequence, with_kwargs=True)
            blocks = decoder_blocks(part)
            for name, block in blocks:  # the blocks' norms work on sequence shards
                for sub_name, sub in block.named_modules():
                    if "norm" in type(sub).__name__.lower() and any(True for _ in sub.parameters(recurse=False)):
                        resolved[f"{name}.{sub_name}"] = SequenceParallel(use_local_output=True)
            # The model's own code (masks, positions) sees whole sequences: split them entering this stage's
            # first block, gather them leaving its last.
            resolved[blocks[0][0]] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                        desired_input_layouts=(Shard(1),), use_local_output=True)
            last = blocks[-1][0]
            if last == blocks[0][0]:
                parallelize_module(part.get_submodule(last), self.tp_mesh, resolved.pop(last))
            resolved[last] = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
        parallelize_module(part, self.tp_mesh, resolved)
        self._replicate_the_rest(part)

    def _gather_sequence(self, module, args, kwargs):
        """Forward pre-hook: the sequence-split hidden states (first argument or `hidden_states=`) made whole
        (an all-gather whose backward reduce-scatters)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        def whole(x):
            d = DTensor.from_local(x, self.tp_mesh, [Shard(1)], run_check=False)
            return d.redistribute(self.tp_mesh, [Replicate()]).to_local()

        if args:
            args = (whole(args[0]), *args[1:])
        elif "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=whole(kwargs["hidden_states"]))
        return args, kwargs

    def _replicate_the_rest(self, part) -> None:
        """Modules the plan leaves whole (norms; embeddings/head when not split) get their parameters as
        replicated DTensors, taking and returning plain tensors: every parameter is then a DTensor, which the
        optimizer's and clipping's fused kernels need (they can't mix DTensors and tensors)."""
        from torch.distributed.tensor import DTensor, Replicate, distribute_module

        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def to_local(mod, outputs, mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        for module in list(part.modules()):
            own = [p for p in module.parameters(recurse=False)]
            if own and not all(isinstance(p, DTensor) for p in own):
                distribute_module(module, self.tp_mesh, input_fn=to_dtensor, output_fn=to_local)

    def _load_seeded(self, units) -> None:
        from models.init import named_tensors

        targets = {}
        for _, part in self.parts:
            targets.update(named_tensors(part))
        with torch.no_grad():
            for values in units:
                for name, value in values.items():
                    if name in targets:
                        _write(targets[name], lambda index, v=value: v[index] if index is not None else v)

    def _state_view(self, model) -> nn.Module:
        """One module holding every stage module of this rank under its full-model name (checkpoints and the
        optimizer see the parameters with their usual names); never run forward."""
        view = copy.deepcopy(model)  # meta shell
        blocks = view.get_submodule(self.split.layers)
        blocks._modules = {}
        for path in self.split.first + self.split.last:
            _set_module(view, path, None)
        for stage, part in self.parts:
            for key, block in part.get_submodule(self.split.layers)._modules.items():
                blocks._modules[key] = block
            ends = (self.split.first if stage == 0 else []) + (self.split.last if stage == self.num_stages - 1 else [])
            for path in ends:
                _set_module(view, path, part.get_submodule(path))
        return view

    # ---- pipeline schedule -----------------------------------------------------------------------------------
    def _build_schedule(self) -> None:
        import torch.distributed.pipelining.schedules as schedules
        from torch.distributed.pipelining import PipelineStage

        from trainer import config as C

        self.stages = [PipelineStage(self.stage_modules[stage], stage, self.num_stages, self.device,
                                     group=self.pp_group) for stage, _ in self.parts]
        cls = getattr(schedules, SCHEDULES[self.cfg.strategy.pp_schedule][0])
        n_micro = C.grad_accumulation_steps(self.cfg, self.dims.dp_size)
        stages = self.stages if len(self.stages) > 1 or SCHEDULES[self.cfg.strategy.pp_schedule][1] != 1 \
            else self.stages[0]
        self.schedule = cls(stages, n_microbatches=n_micro, loss_fn=self._pipeline_loss, scale_grads=False)
        self._ce_sums = []

    def _pipeline_loss(self, logits, labels):
        ce_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        self._ce_sums.append(ce_sum.detach())
        return ce_sum / self._n_target

    @property
    def _last_stages_here(self) -> int:
        return int(self.has_last_stage)

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.my_stages

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.my_stages

    def forward_backward(self, micro_batches, num_target_tokens: int) -> torch.Tensor:
        if self.dims.pp == 1:
            return super().forward_backward(micro_batches, num_target_tokens)
        self._n_target = num_target_tokens
        self._ce_sums = []
        inputs = to_device(torch.cat([b["input_ids"] for b in micro_batches]), self.device)
        labels = to_device(torch.cat([b["labels"] for b in micro_batches]), self.device)
        args = (inputs,) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        self.schedule.step(*args, target=target, losses=[] if self.has_last_stage else None)
        # The schedule calls the loss once more, on placeholder values, when it infers shapes in its first step:
        # the real micro-batches are the last ones.
        real = self._ce_sums[-len(micro_batches) * self._last_stages_here:]
        total = torch.stack(real).sum() if real else torch.zeros((), device=self.device)
        return self._pp_sum(total)

    def _pp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Only the last stage has the loss: share it with the other stages of this pipeline."""
        if self.pp_group is not None:
            t = t.clone()
            dist.all_reduce(t, group=self.pp_group)
        return t

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches) -> torch.Tensor:
        if self.dims.pp == 1:
            return super().eval_loss_sum(micro_batches)
        # Forward only, stage by stage with point-to-point sends (batches may differ in size, which a
        # schedule's fixed shapes would not take).
        total = torch.zeros((), device=self.device)
        owner = {}
        v_shape = SCHEDULES[self.cfg.strategy.pp_schedule][1] == "v"
        for r in range(self.dims.pp):
            for stage in stage_indices(r, self.dims.pp, self.num_stages // self.dims.pp, v_shape):
                owner[stage] = r
        peers = dist.get_process_group_ranks(self.pp_group)
        hidden_size = self.parts[0][1].config.get_text_config().hidden_size
        for batch in micro_batches:
            ids = batch["input_ids"].to(self.device)
            x = None
            for stage in range(self.num_stages):
                if owner[stage] != self.pp_rank:
                    continue
                if stage > 0 and owner[stage - 1] != self.pp_rank:
                    x = torch.empty(*ids.shape, hidden_size, device=self.device)
                    dist.recv(x, src=peers[owner[stage - 1]], group=self.pp_group)
                x = self.stage_modules[stage](ids if stage == 0 else x)
                if stage == self.num_stages - 1:
                    total += F.cross_entropy(x.float().flatten(0, 1), batch["labels"].to(self.device).flatten(),
                                             ignore_index=IGNORE, reduction="sum")
                elif owner[stage + 1] != self.pp_rank:
                    dist.send(x.float().contiguous(), dst=peers[owner[stage + 1]], group=self.pp_group)
        return self._pp_sum(total)

    # ---- the rest of a step ----------------------------------------------------------------------------------
    def dp_group(self):
        return self._dp_group

    def grad_norm_and_clip(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every stage, tensor shard and data shard."""
        from torch.distributed.tensor import DTensor

        params = [p for p in self.state_model.parameters() if p.grad is not None]
        groups = {}
        for p in params:
            key = (id(p.grad.device_mesh), tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for grads in groups.values():
            n = torch.nn.utils.get_total_norm(grads, 2.0)
            if isinstance(n, DTensor):
                n = n.full_tensor()
            sq = sq + n.float().to(self.device) ** 2
        norm = self._pp_sum(sq).sqrt()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # ---- export: one parameter at a time, from whichever stage holds it --------------------------------------
    def export_hf(self, out_dir: str, tokenizer) -> None:
        from trainer.strategies.base import write_hf_folder_streaming

        write_hf_folder_streaming(self.parts[0][1].config, tokenizer, out_dir, self._gathered(), dist.get_rank() == 0)
        dist.barrier()

    def _gathered(self):
        from torch.distributed.tensor import DTensor

        from models.init import meta_model

        full = meta_model(self.parts[0][1].config)
        mine = dict(self.state_model.named_parameters())
        mine.update({k: v for k, v in self.state_model.state_dict().items() if k not in mine})
        owners = [None] * dist.get_world_size()
        dist.all_gather_object(owners, sorted(mine))  # which rank holds which names (small)
        holders = {}
        for rank, names in enumerate(owners):
            for n in names:
                holders.setdefault(n, []).append(rank)
        names = [n for n, _ in full.named_parameters()] + [n for n in full.state_dict()
                                                          if n not in dict(full.named_parameters())]
        me = dist.get_rank()
        for name in names:
            ranks = holders.get(name)
            if not ranks:
                continue
            t = None
            if me in ranks:
                t = mine[name]
                t = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            src = ranks[0]
            if src != 0:
                if me == src:
                    dist.send(t.contiguous(), dst=0)
                elif me == 0:
                    meta = full.get_parameter(name) if name in dict(full.named_parameters()) else None
                    shape = meta.shape if meta is not None else full.state_dict()[name].shape
                    t = torch.empty(shape, device=self.device)
                    dist.recv(t, src=src)
            if me == 0:
                yield name, t
            else:
                yield name, torch.empty(0)


def _grads_in_param_layout(module) -> None:
    """Each DTensor parameter's gradient in the parameter's own layout. Torch's embedding backward returns the
    vocabulary-split weight's gradient Replicate: without this, every tensor-parallel rank would hold the whole
    embedding gradient (vocabulary x hidden) until the optimizer step. Replicate -> Shard keeps the local slice, no
    communication (FSDP2 does the same for the parameters it manages)."""
    from torch.distributed.tensor import DTensor

    def hook(param):
        def to_param_layout(grad):
            if isinstance(grad, DTensor) and grad.placements != param.placements:
                return grad.redistribute(param.device_mesh, param.placements)
            return grad
        return to_param_layout

    for p in module.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_hook(hook(p))
