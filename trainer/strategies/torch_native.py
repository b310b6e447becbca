"""Torch-native layouts, one strategy over the validated degrees (pp, dp_replicate, dp_shard, cp, tp; ep borrows
data ranks): `fsdp` and `hsdp` (FSDP2), `tp`, `pp`, and the hybrids `fsdp_tp` (2-D), `pp_fsdp` (2-D) and `3d`.

Each parallelism is one function, applied in order as torchtitan does: the model (parameters on the meta device)
is cut into pipeline stages (trainer/parallel/pipeline.py), each stage's modules are split by the model's
tensor-parallel plan (trainer/parallel/tensor_parallel.py `apply_tp`), its attention routed across the context
ranks (trainer/parallel/context_parallel.py, `strategy.cp`), its experts split over the expert ranks
(trainer/parallel/expert_parallel.py `apply_ep`, `strategy.ep`), and each stage is sharded over the data (x context)
ranks with FSDP2 (trainer/parallel/fsdp.py `apply_fsdp`) when FSDP is on; then shards are allocated and
filled, one block of seeded weights or one pretrained tensor's slice at a time. Activation checkpointing and
compile (`Strategy.prepare_blocks`) go on each stage's decoder blocks after tensor parallelism, before FSDP.

Precision is decided once, here: where FSDP is applied its mixed-precision policy casts the gathered parameters
(and autocast stays off); elsewhere (tp, pp without data parallelism) autocast computes in the precision's
dtype. fp16 scales every layout's loss, the pipeline's included; the found-inf flag is agreed by all ranks.

The loss of each pipeline micro-batch is its token cross-entropy *sum* divided by the global batch's
target-token count and the schedule does not rescale gradients (`scale_grads=False`): accumulation over
micro-batches is then exactly the token-normalized global loss, never a mean of means (pytorch/torchtitan#1733).
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import replace
from typing import List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.pipelining.schedules as schedules
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from models import plans
from models.init import decoder_blocks, meta_model, named_tensors
from models.lora import meta_adapted
from models.weights import is_checkpoint
from tessera.errors import TesseraError
from trainer.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from trainer.checkpoint.saved import SavedCheckpoint
from trainer.config import schema as C
from trainer.data.datasets import IGNORE
from trainer.parallel import fsdp as F2
from trainer.parallel.context_parallel import (ContextParallel, cp_model_problems, cp_problems, sharded_or_whole,
                                               total_over)
from trainer.parallel.dims import device_type
from trainer.parallel.expert_parallel import apply_ep, ep_problems, expert_modules
from trainer.parallel.grad_norm import clip_to_norm, world_square_sum
from trainer.parallel.pipeline import (SCHEDULES, SPLIT_BACKWARD_SCHEDULES, StageModule, cut_stage, set_module,
                                       stage_indices, stages_per_rank)
from trainer.parallel.sync import Worker
from trainer.parallel.tensor_parallel import apply_tp, count_functional_collectives, grads_in_param_layout
from trainer.run.loss import to_device
from trainer.run.precision import cast_buffers_in_model_dtype
from trainer.strategies.base import Strategy
from trainer.strategies.capabilities import DTENSORS, TENSORS, Capabilities

# Strategies that shard with FSDP even over one data-parallel rank.
_ALWAYS_FSDP = ("fsdp", "hsdp")
# What a pipeline step reads of a batch (position ids: packed documents')
_STAGE_KEYS = ("input_ids", "labels", "position_ids")


class TorchNativeStrategy(Strategy):
    name = "fsdp"
    names = ("fsdp", "hsdp", "tp", "pp", "fsdp_tp", "pp_fsdp", "3d")
    # Pretrained weights come to load_initial_weights, each rank reading only its part.
    capabilities = Capabilities(degrees=frozenset({"dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"}),
                                fsdp_options=True,
                                loads_pretrained_weights=True,
                                fault_tolerance=frozenset({"torchft"}))

    @classmethod
    def capabilities_for(cls, cfg) -> Capabilities:
        """fsdp / hsdp name their degrees; torchft replica groups over FSDP2 layouts only (each group shards and
        replicates inside itself; the groups are the outer replicas); local SGD / DiLoCo across hsdp's replica
        groups (each group a worker, sharded inside). Neither with tensor or pipeline parallelism."""
        s = cfg.strategy
        plain = s.tp == 1 and s.pp == 1
        return replace(cls.capabilities,
                       degrees=frozenset({"dp_replicate", "dp_shard", "cp", "ep"}) if s.name in _ALWAYS_FSDP else
                       cls.capabilities.degrees,
                       fault_tolerance=cls.capabilities.fault_tolerance if s.name in _ALWAYS_FSDP and plain else
                       frozenset(),
                       periodic_sync=s.name == "hsdp" and plain)

    @classmethod
    def layout_problems(cls, cfg, world_size: int) -> List[str]:
        s = cfg.strategy
        problems = []
        if s.name == "fsdp" and s.dp_replicate not in (1,):
            problems.append(f"strategy=fsdp shards over every rank: strategy.dp_replicate must be 1 (got "
                            f"{s.dp_replicate}); for replicated shard groups use strategy=hsdp")
        problems += F2.fsdp_config_problems(cfg)
        if s.pp_schedule not in SCHEDULES:
            problems.append(f"strategy.pp_schedule={s.pp_schedule!r} is not one of {', '.join(SCHEDULES)}")
        elif s.pp_stages_per_rank < 1:
            problems.append("strategy.pp_stages_per_rank must be >= 1")
        if cfg.train.compile and s.pp not in (1,):
            problems.append(f"train.compile=true is not supported with pipeline parallelism (strategy.pp={s.pp}); "
                            f"set train.compile=false")
        if s.cpu_offload and cfg.sync.name != "every_step":
            problems.append(f"sync={cfg.sync.name} with strategy.cpu_offload=true is not supported (the workers' "
                            f"shards would be synchronised from host memory); set strategy.cpu_offload=false")
        if s.cpu_offload and (s.tp != 1 or s.pp != 1):
            problems.append(f"strategy.cpu_offload=true is available without tensor and pipeline parallelism only "
                            f"(got strategy.tp={s.tp}, strategy.pp={s.pp}); set strategy.cpu_offload=false")
        return problems

    @classmethod
    def fsdp_applies(cls, name: str, dims) -> bool:
        """FSDP shards over the data-parallel and the context ranks (which then sum their gradients)."""
        return name in _ALWAYS_FSDP or dims.dp_size > 1 or dims.cp_enabled

    @classmethod
    def optimizer_parameters(cls, cfg, dims) -> str:
        """DTensors where FSDP or tensor parallelism applies; a pipeline stage alone keeps plain tensors."""
        return DTENSORS if cls.fsdp_applies(cfg.strategy.name, dims) or dims.tp_enabled else TENSORS

    @classmethod
    def model_problems(cls, cfg, info, dims) -> List[str]:
        """Checks that need the model's shape and the degrees (called before any process group starts)."""
        s = cfg.strategy
        problems = []
        if not cls.fsdp_applies(s.name, dims):
            for key in ("param_dtype", "reduce_dtype"):
                if getattr(s, key) is not None:
                    problems.append(f"strategy.{key}={getattr(s, key)} sets FSDP's mixed precision, but this layout "
                                    f"has no data-parallel ranks to shard over (strategy={s.name}, data-parallel "
                                    f"degree {dims.dp_size}); leave it unset (precision= sets the compute dtype)")
        model = meta_model(info.hf_config)
        if dims.tp > 1:
            problems += plans.tp_plan_problems(model, info, dims.tp)
            if s.sequence_parallel and cfg.data.seq_len % dims.tp:
                problems.append(f"strategy.sequence_parallel=true splits data.seq_len={cfg.data.seq_len} over "
                                f"strategy.tp={dims.tp}: it must divide")
            if s.sequence_parallel and plans.is_moe(model):
                problems.append(f"strategy.sequence_parallel=true with a mixture-of-experts model "
                                f"({info.hf_config.model_type}) is not supported: its experts stay whole on every "
                                f"tensor-parallel rank; set strategy.sequence_parallel=false")
        if cfg.peft.name != "none" and (dims.tp > 1 or dims.pp > 1):
            # peft's layers replace the linear modules that tensor parallelism splits, and the stages would train
            # adapters of a fraction of the model each
            problems.append(f"peft=lora is not available with tensor or pipeline parallelism (strategy={s.name}: "
                            f"tensor-parallel degree {dims.tp}, pipeline degree {dims.pp}): adapters hold a small "
                            f"fraction of the parameters, so shard the frozen base with strategy=fsdp or hsdp (or "
                            f"a ZeRO stage) instead")
        problems += cp_problems(cfg, info, dims, device_type(cfg.train.device)) + cp_model_problems(model, dims.cp)
        problems += cls._ep_problems(cfg, dims, model)
        if dims.pp > 1 and cfg.data.kind == "mixture":
            problems.append(f"data.kind=mixture is not available with pipeline parallelism (strategy.pp={dims.pp}): "
                            f"the last stage's loss does not see the rows' tasks; use strategy.pp=1")
        if dims.pp > 1 and s.pp_schedule in SCHEDULES:
            problems += cls._pipeline_problems(cfg, info, dims, model)
        return problems

    @classmethod
    def _ep_problems(cls, cfg, dims, model) -> List[str]:
        """strategy.ep: the (meta) model's experts split that many ways, beside FSDP alone (with context
        parallelism)."""
        if not dims.ep_enabled:
            return []
        problems = ep_problems(model, dims.ep)
        if dims.pp > 1:
            problems.append(f"strategy.ep={dims.ep} with pipeline parallelism (strategy.pp={dims.pp}) is not "
                            f"supported yet: the experts are split over data-parallel ranks; use strategy=fsdp, "
                            f"hsdp or fsdp_tp (with strategy.cp if you like)")
        if cfg.sync.name != "every_step":
            problems.append(f"strategy.ep={dims.ep} with sync={cfg.sync.name} is not supported: the experts of one "
                            f"replica are split over its ranks; use sync=every_step")
        return problems

    @classmethod
    def _pipeline_problems(cls, cfg, info, dims, model) -> List[str]:
        """The pipeline split, schedule and micro-batch count for this model and layout."""
        s, problems = cfg.strategy, []
        if plans.pipeline_split(model) is None:
            problems.append(f"strategy.pp={dims.pp}: Tessera finds no pipeline split for the "
                            f"{info.hf_config.model_type} architecture (its decoder blocks and the modules "
                            f"before and after them); set strategy.pp=1")
        if s.pp_schedule in SPLIT_BACKWARD_SCHEDULES and cls.fsdp_applies(s.name, dims):
            # Measured (torch 2.13, pp 2 x dp_shard 2, fp32): the gradient norm 40-60% off one process with
            # interleaved_zb and zbv, 3e-4 with dualpipev; the other schedules match to 1e-7.
            problems.append(f"strategy.pp_schedule={s.pp_schedule} splits the backward into input and weight "
                            f"passes, which FSDP's gradient reduction does not follow (torch's pipelining drops "
                            f"part of the weight gradients): with data or context parallelism (data-parallel "
                            f"degree {dims.dp_size}, strategy.cp={dims.cp}) use "
                            f"strategy.pp_schedule=1f1b, interleaved_1f1b, looped_bfs or gpipe; the zero-bubble "
                            f"schedules run with pipeline (and tensor) parallelism alone")
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

    def __init__(self, cfg, dims, device, precision):
        super().__init__(cfg, dims, device, precision)
        self.fsdp_enabled = self.fsdp_applies(cfg.strategy.name, dims)
        # torch.compile'd tensor-parallel blocks run their collectives inside compiled code, which comm_bytes
        # cannot see.
        self.caps = replace(self.caps, counts_all_collectives=not (dims.tp_enabled and cfg.train.compile))
        self.param_dtype, self.reduce_dtype = F2.fsdp_dtypes(cfg) if self.fsdp_enabled else (None, None)
        # One decision for every layout: FSDP casts what it gathers (no autocast on top); without FSDP, autocast.
        self.precision = precision.with_cast_by_wrapper(self.fsdp_enabled)
        if precision.scaler is not None:
            # DTensor gradients; the found-inf flag is all-reduced over every rank, so all stages and shards skip
            # a step together.
            p = cfg.precision
            self.precision.scaler = F2.ScalarFoundInfScaler(
                device.type, init_scale=p.init_scale, growth_factor=p.growth_factor,
                backoff_factor=p.backoff_factor, growth_interval=p.growth_interval, process_group=None)

    def model_construction(self, pretrained: bool):
        from accelerate import init_empty_weights  # start-up time

        return init_empty_weights(include_buffers=False)

    # ---- building ------------------------------------------------------------------------------------------
    def setup(self, model, build_optimizer, initial_weights=None):
        """Mesh, pipeline cut, then per part: apply_tp, activation checkpointing and compile, apply_fsdp; then the
        weights, the optimizer and the schedule."""
        d = self.dims
        count_functional_collectives()
        # Built under empty weights, a model whose config ties the embeddings and the head holds two parameters:
        # tie them (as from_config / from_pretrained do), so every layout trains one weight.
        model.tie_weights()
        self._build_meshes()
        self._cut_stages(model)
        for stage, part in self.parts:
            self._parallelize(part, self.stage_modules.get(stage, part))
        self.load_initial_weights(None, initial_weights)
        # FSDP casts the parameters, no autocast
        cast_buffers_in_model_dtype([part for _, part in self.parts], self.param_dtype)
        self.state_model = self._state_view(model) if len(self.parts) > 1 else self.parts[0][1]
        self.model = self.state_model
        self.optimizer = build_optimizer(self.state_model.named_parameters())
        # peft=lora's frozen base: sharded like the rest, outside the optimizer (the memory report counts them)
        self.frozen_shards = [p for p in self.state_model.parameters() if not p.requires_grad]
        if self.precision.scaler is not None:  # stages without the loss never call scale(), which sets it up
            self.precision.scaler.scale(torch.zeros((), device=self.device))
        if d.pp_enabled:
            self._build_schedule()
        if self.tied:
            self._tie_group = self._tied_stages_group()
        return self.model, self.optimizer

    def _build_meshes(self) -> None:
        """The device mesh and its groups (with independent replicas, hsdp's replica groups are local-SGD workers:
        FSDP reduces inside a group, and a worker measures its gradient norm over its group)."""
        d, s = self.dims, self.cfg.strategy
        mesh = self.dims.build_mesh(self.device.type)
        self.world_mesh = mesh
        self.tp_mesh = mesh["tp"] if d.tp_enabled else None
        self.pp_group = mesh["pp"].get_group() if d.pp_enabled else None
        self._dp_group = mesh["dp_replicate", "dp_shard"]._flatten().get_group() if d.dp_enabled else None
        self.pp_rank = mesh["pp"].get_local_rank() if d.pp_enabled else 0
        # FSDP shards over the data and context ranks together (torchtitan's dp_shard_cp)
        shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp") if d.cp_enabled else mesh["dp_shard"]
        if (d.dp_replicate_enabled or s.name == "hsdp") and not self.independent_replicas:
            self.dp_mesh = mesh["dp_replicate", "dp_shard_cp" if d.cp_enabled else "dp_shard"]
        else:
            self.dp_mesh = shard  # with local workers FSDP reduces inside the group only
        self._worker_group = self.dp_mesh.get_group() if self.independent_replicas and d.dp_size > 1 else None
        self.cp = ContextParallel(mesh["cp"], s.cp_impl) if d.cp_enabled else None
        self.ep_mesh = self.experts_fsdp_mesh = None
        if d.ep_enabled:
            self.ep_mesh, self.experts_fsdp_mesh = self._expert_meshes(mesh)

    def _expert_meshes(self, mesh):
        """(the experts' mesh, their FSDP mesh): the dp_shard x cp ranks split into (dp_mod_ep, ep), expert-parallel
        ranks innermost, as one mesh (FSDP's 2-D sharding of the experts needs both from one root). With tensor
        parallelism the experts' mesh is (ep, tp): every tp rank of an expert rank holds its experts whole."""
        d = self.dims
        ranks = mesh.mesh.reshape(d.pp, d.dp_replicate, d.dp_shard * d.cp // d.ep, d.ep, d.tp)
        experts = DeviceMesh(self.device.type, ranks, mesh_dim_names=("pp", "dp_replicate", "dp_mod_ep", "ep", "tp"))
        hsdp = d.dp_replicate_enabled or self.cfg.strategy.name == "hsdp"
        placed = experts["ep", "tp"] if d.tp_enabled else experts["ep"]
        return placed, experts["dp_replicate", "dp_mod_ep"] if hsdp else experts["dp_mod_ep"]

    def _cut_stages(self, model) -> None:
        """This rank's pipeline stages as parts of the model (the whole model without pipeline parallelism)."""
        d, s = self.dims, self.cfg.strategy
        self.split = plans.pipeline_split(model) if d.pp_enabled else None
        # Tied embeddings across stages (Megatron's way): the first stage holds the embedding, the last a copy of
        # it as the head; both start from the same values and their gradients are summed after backward, so they
        # stay equal; the norm counts the weight once.
        self.tied = None
        if d.pp_enabled and plans.ties_embeddings(model):
            self.tied = plans.embedding_weight_names(model)
        v_shape = SCHEDULES[s.pp_schedule][1] == "v"
        per_rank = stages_per_rank(s) if d.pp_enabled else 1
        self.num_stages = d.pp * per_rank
        self.my_stages = stage_indices(self.pp_rank, d.pp, per_rank, v_shape) if d.pp_enabled else [0]
        layer_ranges = plans.stage_layers(len(decoder_blocks(model)), self.num_stages, s.pp_split_points)
        self.parts = []  # (stage index, HF model holding that stage's modules)
        for stage in self.my_stages:
            part = model if len(self.my_stages) == 1 else copy.deepcopy(model)
            if d.pp_enabled:
                cut_stage(part, self.split, stage == 0, stage == self.num_stages - 1, layer_ranges[stage])
            self.parts.append((stage, part))
        # With pipeline stages, the stage module is the root that FSDP wraps (and the pipeline runs): its
        # forward may skip the causal LM's own.
        self.stage_modules = {stage: StageModule(part, stage == 0, stage == self.num_stages - 1, self.cp)
                              for stage, part in self.parts} if d.pp_enabled else {}

    def _parallelize(self, part, root) -> None:
        """apply_tp, activation checkpointing and compile, apply_fsdp, then the parameters on the device."""
        d, s = self.dims, self.cfg.strategy
        if d.tp_enabled:
            apply_tp(part, plans.tp_plan(part, d.tp), self.tp_mesh, s.sequence_parallel)
        if self.cp is not None:
            self.cp.apply(part)
        experts = []
        if self.ep_mesh is not None:
            apply_ep(part, self.ep_mesh)
            experts = [(m, self.experts_fsdp_mesh) for _, m in expert_modules(part)]
        self.prepare_blocks(part)  # activation checkpointing, compile
        if self.fsdp_enabled:
            F2.apply_fsdp([b for _, b in decoder_blocks(part)], root, self.dp_mesh, self.param_dtype,
                          self.reduce_dtype, s.reshard_after_forward, s.cpu_offload,
                          pin_memory=self.device.type == "cuda", inner=experts)
        F2.materialize(root, self.device, s.cpu_offload)  # new parameter objects: hooks go on after it
        if d.tp_enabled and not self.fsdp_enabled:
            grads_in_param_layout(part)

    # ---- local SGD / DiLoCo across hsdp's replica groups (trainer/parallel/sync.py) -----------------------
    def local_worker(self):
        """Each replica group is a worker; rank i of every group holds the same shard, so the workers' shards are
        synchronised over the replicate dimension."""
        if not self.independent_replicas:
            return None
        group = self.world_mesh["dp_replicate"].get_group() if self.dims.dp_replicate_enabled else None
        shards = {n: (p.to_local() if isinstance(p, DTensor) else p).detach()  # views of the parameters' storage
                  for n, p in self.state_model.named_parameters() if p.requires_grad}  # peft=lora: the adapters
        return Worker(shards, group, dist.get_world_size(group) if group is not None else 1)

    def local_state(self) -> dict:
        if not self.independent_replicas:
            return {}
        # this worker's shards of the weights and of the optimizer state (plain tensors: the per-rank file is read
        # back with weights_only)
        return {"weights": {n: t.clone() for n, t in self.local_worker().params.items()},
                "optimizer": {str(i): {k: _local(v) for k, v in self.optimizer.state[p].items()}
                              for i, p in enumerate(self.state_model.parameters()) if p in self.optimizer.state}}

    def load_local_state(self, state) -> str:
        if not self.independent_replicas or state is None or "weights" not in state:
            return ""
        with torch.no_grad():
            for n, t in self.local_worker().params.items():
                t.copy_(state["weights"][n])
            for i, p in enumerate(self.state_model.parameters()):
                for k, v in state["optimizer"].get(str(i), {}).items():
                    _local(self.optimizer.state[p][k]).copy_(v)  # in place: the shared checkpoint set them up
        return ""

    # ---- tied embeddings on the first and last pipeline stage ----------------------------------------------------
    def _tied_copies(self) -> list:
        """This rank's copies of the tied weight: the embedding (first stage) and the head (last stage)."""
        embed, head = self.tied
        out = []
        for stage, part in self.parts:
            if stage == 0:
                out.append(part.get_parameter(embed))
            if stage == self.num_stages - 1:
                out.append(part.get_parameter(head))
        return out

    def _tied_stages_group(self):
        """The two ranks of this rank's pipeline that hold the first and the last stage (None where one rank
        holds both, or this rank neither); every rank creates every such group, in the same order."""
        v_shape = SCHEDULES[self.cfg.strategy.pp_schedule][1] == "v"
        last_owner = 0 if v_shape else (self.num_stages - 1) % self.dims.pp
        if last_owner == 0:
            return None
        ranks_of = self.world_mesh.mesh
        mine = None
        for idx in itertools.product(*(range(n) for n in ranks_of.shape[1:])):
            ranks = [int(ranks_of[(0, *idx)]), int(ranks_of[(last_owner, *idx)])]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return mine

    def _sum_tied_grads(self) -> None:
        copies = [p for p in self._tied_copies() if p.grad is not None]
        if not copies:
            return
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in copies]
        total = local[0].clone()
        for t in local[1:]:
            total += t
        if self._tie_group is not None:
            dist.all_reduce(total, group=self._tie_group)
        for t in local:
            t.copy_(total)

    def setup_frozen(self, model, initial_weights=None):
        """The trained model's parallelism (tp, ep, FSDP over the same meshes) on a frozen model; never with pipeline
        stages (the objectives that ask for one refuse pp). Its shards count as frozen parameters in the memory
        report."""
        model.tie_weights()
        model.requires_grad_(False)
        self._parallelize(model, model)
        self._load_full_tensors(named_tensors(model), initial_weights)
        cast_buffers_in_model_dtype([model], self.param_dtype)
        self.frozen_shards += list(model.parameters())
        return model.eval()

    @torch.no_grad()
    def load_initial_weights(self, model, initial_weights) -> None:
        """Each rank writes its part of every tensor of its stages (`model` is unused: the stages are)."""
        targets = {}
        for _, part in self.parts:
            targets.update(named_tensors(part))
        self._load_full_tensors(targets, initial_weights)

    @torch.no_grad()
    def _load_full_tensors(self, targets: dict, initial_weights) -> None:
        if is_checkpoint(initial_weights):
            F2.missing_pretrained(initial_weights, [(n, t) for n, t in targets.items()
                                                    if isinstance(t, nn.Parameter)])
        if self.tied and initial_weights is not None and not is_checkpoint(initial_weights):
            embed, head = self.tied  # seeded units name the tied weight once, as the embedding
            initial_weights = ({**values, head: values[embed]} if embed in values else values
                               for values in initial_weights)
        F2.load_full_tensors(targets, initial_weights)
        if initial_weights is not None and hasattr(initial_weights, "close"):
            initial_weights.close()

    def _state_view(self, model) -> nn.Module:
        """One module holding every stage module of this rank under its full-model name (checkpoints and the
        optimizer see the parameters with their usual names); never run forward."""
        view = copy.deepcopy(model)  # meta shell
        blocks = view.get_submodule(self.split.layers)
        for key, _ in list(blocks.named_children()):
            delattr(blocks, key)  # Module.__delattr__ keeps the other keys (ModuleList's __delitem__ renumbers)
        for path in self.split.first + self.split.last:
            set_module(view, path, None)
        for stage, part in self.parts:
            for key, block in part.get_submodule(self.split.layers).named_children():
                blocks.add_module(key, block)
            ends = (self.split.first if stage == 0 else []) + (self.split.last if stage == self.num_stages - 1 else [])
            for path in ends:
                set_module(view, path, part.get_submodule(path))
        return view

    # ---- pipeline schedule -----------------------------------------------------------------------------------
    def _build_schedule(self) -> None:
        self.stages = [PipelineStage(self.stage_modules[stage], stage, self.num_stages, self.device,
                                     group=self.pp_group) for stage, _ in self.parts]
        cls = getattr(schedules, SCHEDULES[self.cfg.strategy.pp_schedule][0])
        n_micro = C.grad_accumulation_steps(self.cfg, self.dims.dp_size)
        stages = self.stages if len(self.stages) > 1 or SCHEDULES[self.cfg.strategy.pp_schedule][1] != 1 \
            else self.stages[0]
        self.schedule = cls(stages, n_microbatches=n_micro, loss_fn=self._pipeline_loss, scale_grads=False)

    def _pipeline_loss(self, logits, labels):
        """A micro-batch's CE sum over the global batch's target tokens (set by forward_backward), loss-scaled."""
        ce_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        return self.precision.scale(ce_sum / self._n_target)

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.my_stages

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.my_stages

    def forward_backward(self, micro_batches, num_target_tokens: int, grad_weight: float = 1.0) -> torch.Tensor:
        if self.dims.pp == 1:
            return super().forward_backward(micro_batches, num_target_tokens, grad_weight)
        self._n_target = num_target_tokens
        batch = {key: to_device(torch.cat([b[key] for b in micro_batches]), self.device)
                 for key in _STAGE_KEYS if key in micro_batches[0]}
        losses = [] if self.has_last_stage else None  # the schedule's own: each real micro-batch's loss_fn value
        with sharded_or_whole(self.cp, batch) as batch:  # strategy.cp: every stage runs this rank's shard
            args = (batch["input_ids"],) if self.has_first_stage else ()
            target = batch["labels"] if self.has_last_stage else None
            with self.precision.autocast():
                self._schedule_step(*args, target=target, losses=losses, **_stage_kwargs(batch))
        if self.tied:
            self._sum_tied_grads()
        total = torch.zeros((), device=self.device)
        if losses:
            total = self.precision.unscale_value(torch.stack([loss.detach() for loss in losses]).sum())
            total = total * num_target_tokens
        return self._pp_sum(total_over(self.cp, total))

    def recompute_contexts(self):
        """Packed documents over context ranks in pipeline stages: a block recomputes with its own micro-batch's
        documents, not those of the forward the schedule ran last (ContextParallel.micro_batch)."""
        if self.cp is not None and self.dims.pp_enabled and self.cfg.data.packing == "documents":
            return self.cp.recompute_contexts
        return None

    def _schedule_step(self, *args, **kwargs) -> None:
        """schedule.step; an error of Tessera's raised inside a stage (a packed batch's mask check, the context
        ranks' attention) comes out as itself, with its one message and exit code: torch's pipelining wraps
        whatever a stage's forward raises in a RuntimeError."""
        try:
            self.schedule.step(*args, **kwargs)
        except RuntimeError as e:
            if isinstance(e.__cause__, TesseraError):
                raise e.__cause__ from None
            raise

    def _pp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Only the last stage has the loss: share it with the other stages of this pipeline."""
        if self.pp_group is not None:
            t = t.clone()
            dist.all_reduce(t, group=self.pp_group)
        return t

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches) -> torch.Tensor:
        try:
            return self._forward_only_loss_sum(micro_batches)
        finally:
            if self.fsdp_enabled:  # no backward reshards what these forwards gathered (reshard_after_forward=false)
                F2.reshard_all(self)

    def _forward_only_loss_sum(self, micro_batches) -> torch.Tensor:
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
        for batch in micro_batches:
            batch = {k: v.to(self.device) for k, v in batch.items() if k in _STAGE_KEYS}
            with sharded_or_whole(self.cp, batch) as batch:
                total += self._stages_forward(batch, owner)
        return self._pp_sum(total_over(self.cp, total))

    def _stages_forward(self, batch: dict, owner: dict) -> torch.Tensor:
        """One batch through this rank's stages (hidden states sent on to the next stage's rank); -> the CE sum on
        the last stage's rank, else 0."""
        peers = dist.get_process_group_ranks(self.pp_group)
        hidden_size = self.parts[0][1].config.get_text_config().hidden_size
        ids, kwargs = batch["input_ids"], _stage_kwargs(batch)
        x, total = None, torch.zeros((), device=self.device)
        for stage in range(self.num_stages):
            if owner[stage] != self.pp_rank:
                continue
            if stage > 0 and owner[stage - 1] != self.pp_rank:
                x = torch.empty(*ids.shape, hidden_size, device=self.device)
                dist.recv(x, src=peers[owner[stage - 1]], group=self.pp_group)
            with self.precision.autocast():
                x = self.stage_modules[stage](ids if stage == 0 else x, **kwargs)
            if stage == self.num_stages - 1:
                total += F.cross_entropy(x.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE,
                                         reduction="sum")
            elif owner[stage + 1] != self.pp_rank:
                dist.send(x.float().contiguous(), dst=peers[owner[stage + 1]], group=self.pp_group)
        return total

    # ---- the rest of a step ----------------------------------------------------------------------------------
    def dp_group(self):
        return self._dp_group

    def grad_norm_and_clip(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every stage, tensor shard and data shard (fp64 sums, one all-reduce)."""
        params = [p for p in self.state_model.parameters() if p.grad is not None]
        copies = {id(p) for p in self._tied_copies()[1:]} if self.tied and self.has_first_stage else set()
        if self.tied and not self.has_first_stage:
            copies = {id(p) for p in self._tied_copies()}  # the head's copy: the first stage counts the weight
        # a local-SGD worker (an hsdp replica group) measures and clips its own gradient
        group = self._worker_group if self.independent_replicas else None
        norm = world_square_sum([p.grad for p in params if id(p) not in copies], self.device, group).sqrt()
        return clip_to_norm(params, norm, max_norm)

    # ---- checkpoints: the tied head's copy reads the embedding's entries where a checkpoint has no others -----
    def load_checkpoint_from(self, saved_checkpoint: SavedCheckpoint, group) -> None:
        """A checkpoint saved by a layout that holds a tied weight once has no optimizer state for the last stage's
        head copy (DCP saves it under the embedding's name): the copy loads the embedding's. Pipeline checkpoints
        hold both copies and load as they are."""
        if not self.tied:
            return super().load_checkpoint_from(saved_checkpoint, group)
        folder, weights_only = saved_checkpoint.folder, saved_checkpoint.weights_only

        embed, head = self.tied
        saved = SafeFileSystemReader(folder).read_metadata().state_dict_metadata
        state = self.checkpoint_state(model_only=weights_only)
        aside = {}  # section -> the head copy's entry, filled from the embedding's after loading
        for section, entries in state.items():
            if head not in entries or any(k == f"{section}.{head}" or k.startswith(f"{section}.{head}.")
                                          for k in saved):
                continue  # (DCP keeps both names of a tied weight in the model section, one in the optimizer's)
            aside[section] = entries.pop(head)
            if embed not in entries:  # this rank holds only the head copy: load it under the embedding's name
                entries[embed] = aside[section]
        dcp.load(state, checkpoint_id=folder, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(),
                 process_group=group, no_dist=group is None)
        for section, value in aside.items():
            loaded = state[section][embed]
            if loaded is not value:  # both copies here: copy the embedding's into the head's
                _copy_tree(value, loaded)
                state[section][head] = value
            else:
                state[section][head] = state[section].pop(embed)
        self.load_checkpoint_state(state, None if weights_only else saved_checkpoint.param_groups)

    # ---- the memory report's probe points (logging.memory_report: trainer/observe/) --------------------------
    def watch_memory(self, snap) -> list:
        undo = []
        for root, modules in F2.fsdp_trees(self):
            undo += F2._watch_fsdp(snap, root, modules)
        return undo

    @property
    def hf_config(self):
        return self.parts[0][1].config  # every stage's part carries the whole model's config

    def full_tensors(self):
        full = meta_adapted(self.parts[0][1].config, self.cfg.peft)
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


def _stage_kwargs(batch: dict) -> dict:
    """What every pipeline stage is given beside its input: a context-parallel shard's position ids, or packed
    documents' (trainer/parallel/pipeline.StageModule)."""
    if "shard_position_ids" in batch:
        return {"position_ids": batch["shard_position_ids"],
                **{k: batch[k] for k in ("document_position_ids",) if k in batch}}
    return {"packed_position_ids": batch["position_ids"]} if "position_ids" in batch else {}


@torch.no_grad()
def _copy_tree(dst, src) -> None:
    """Copy a tensor or a dict of tensors (optimizer state) into one of the same structure."""
    if isinstance(dst, dict):
        for k in dst:
            _copy_tree(dst[k], src[k])
    elif isinstance(dst, torch.Tensor):
        dst.copy_(src)


def _local(t):
    """A DTensor's local part (an optimizer state entry of a sharded parameter), a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t
