"""The strategy interface: the parallelism only. A strategy turns a model into a parallel model and owns
forward/backward, the optimizer step, the gradient norm, the data-parallel reductions, the state it saves and loads,
and the full tensors an export writes. What it runs with is its Capabilities (checked by trainer/config/compat.py);
its memory figures, planner estimate and live export are functions in trainer/observe/, trainer/planner/ and
trainer/exporting/. The training loop talks only to this interface and the run's services.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import ClassVar, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_model_state_dict, set_state_dict)

from models.init import copy_full_tensors
from models.lora import full_tensors
from trainer.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from trainer.checkpoint.saved import SavedCheckpoint, groups_by_name
from trainer.parallel.blocks import apply_activation_checkpointing, apply_compile
from trainer.parallel.context_parallel import sharded_or_whole, total_over
from trainer.parallel.grad_norm import clip_to_norm, grad_square_sum
from trainer.run.loss import TaskLosses, micro_batch_losses, to_device, token_loss_sum
from trainer.strategies.capabilities import TENSORS, Capabilities


class Strategy:
    name: ClassVar[str] = "base"
    capabilities: ClassVar[Capabilities] = Capabilities()  # what it runs with (trainer/config/compat.py checks)

    def __init__(self, cfg, dims, device: torch.device, precision):
        self.cfg, self.dims, self.device, self.precision = cfg, dims, device, precision
        self.caps = self.capabilities_for(cfg)
        self.model = None
        self.optimizer = None
        self.skip_nonfinite = cfg.train.on_nonfinite == "skip"
        # sync=local_sgd|diloco: each data-parallel replica trains on its own between synchronisations (the run's
        # trainer/parallel/sync.py context); the strategy then reduces no gradients across replicas
        self.independent_replicas = cfg.sync.name != "every_step"
        self.tasks = None  # TaskLosses of the step in progress (data.kind=mixture; track_tasks)
        self.adapters = None  # peft=lora: models.lora.Adapters of the model (set before setup)
        self.router = None  # a mixture of experts' load-balancing loss: trainer/run/router_loss.RouterBalance
        self.objective = None  # trainer/objectives/objective.py (None: the token cross-entropy)
        # strategy.cp > 1: trainer/parallel/context_parallel.ContextParallel (each rank a shard of every sequence)
        self.cp = None

    # ---- checks before any process group starts (trainer/config/compat.py) ------------------------------
    @classmethod
    def capabilities_for(cls, cfg) -> Capabilities:
        """The capabilities of this strategy in the layout and precision `cfg` asks for."""
        return cls.capabilities

    @classmethod
    def layout_problems(cls, cfg, world_size: int) -> List[str]:
        """This strategy's own checks of its options and layout, beyond the capabilities."""
        return []

    @classmethod
    def optimizer_parameters(cls, cfg, dims) -> str:
        """What the optimizer steps in this layout (capabilities.TENSORS, DTENSORS or FLAT_PARTITIONS)."""
        return TENSORS

    @classmethod
    def model_problems(cls, cfg, info, dims) -> List[str]:
        """Checks that need the model's shape and the parallel degrees (before any process group starts)."""
        return []

    # ---- data-parallel coordinates --------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.dims.dp_coordinates(dist.get_rank() if dist.is_initialized() else 0)[0]

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def eval_coordinates(self):
        """(rank, size) among the ranks that split the validation set: this process group's data-parallel ranks
        (with replica groups each group evaluates the whole set itself)."""
        return self.dp_rank - self.dims.replica_group * self.dims.group_dp_size, self.dims.group_dp_size

    # ---- setup ----------------------------------------------------------------------------------------
    def use_adapters(self, adapters) -> None:
        """peft=lora: the models.lora.Adapters injected into the model, before setup (checkpoints and exports then
        hold the adapters, the frozen base coming from the model's own weights)."""
        self.adapters = adapters

    def use_router_balance(self, router) -> None:
        """Add a mixture of experts' router load-balancing term (RouterBalance, or None: off) to each micro-batch's
        loss."""
        self.router = router

    def use_objective(self, objective) -> None:
        """The loss each micro-batch's logits give (trainer/objectives/objective.py); None: token cross-entropy."""
        self.objective = objective

    def router_aux_loss(self):
        """The mean load-balancing term of the last step's micro-batches over all data-parallel ranks, or None."""
        if self.router is None or self.router.sum is None:
            return None
        return float(self.dp_sum(self.router.sum)) / (self.router.count * self.dp_size)

    def model_construction(self, pretrained: bool):
        """Context in which the model is built (and pretrained weights loaded); sharding strategies make each
        rank hold only its part from the start."""
        return nullcontext()

    def setup(self, model, build_optimizer, initial_weights=None):
        """Parallelize `model`, write `initial_weights` into it (preset models: an iterable of
        {name: full tensor} per init unit, see models/init.py; None for pretrained weights, already loaded), and
        create its optimizer with `build_optimizer(named_parameters)`."""
        raise NotImplementedError

    def setup_frozen(self, model, initial_weights=None):
        """Parallelize a second model as setup did the trained one, for forward passes only (no optimizer, no
        gradients, eval mode; a preference objective's live reference) -> the module to call. Each rank holds it
        whole here."""
        model.requires_grad_(False)
        self.prepare_blocks(model)  # compiled like the trained model's blocks, so both compute alike
        self.load_initial_weights(model, initial_weights)
        return model.to(self.device).eval()

    def prepare_blocks(self, model) -> None:
        """Activation checkpointing, then compile, on the decoder blocks: each strategy's setup calls it once the
        blocks are what they will compute with (after tensor parallelism, before FSDP or another wrapper)."""
        apply_activation_checkpointing(model, self.cfg.train, self.recompute_contexts())
        apply_compile(model, self.cfg.train)

    def recompute_contexts(self):
        """Activation checkpointing's `context_fn` where a block's recomputation needs its forward's state, else
        None (torch's own)."""
        return None

    def load_initial_weights(self, model, initial_weights) -> None:
        """Write full tensors into a model that each rank holds whole; sharding strategies override this to
        write only their shards."""
        if initial_weights is not None:
            copy_full_tensors(model, initial_weights)

    def unwrapped(self):
        """The plain Hugging Face model (its parameters may be sharded in other strategies)."""
        return self.model

    @property
    def hf_config(self):
        """The Hugging Face config of the whole model (what an export writes as config.json)."""
        return self.unwrapped().config

    @property
    def generation_config(self):
        """The model's generation config (what an export writes as generation_config.json), None if it has none."""
        return getattr(self.unwrapped(), "generation_config", None)

    def track_tasks(self, num_tasks: int) -> None:
        """Keep per-task loss sums of every step (data.kind=mixture: each batch row carries its task)."""
        self.tasks = TaskLosses(num_tasks, self.device)

    def task_sums(self):
        """[task, (token-loss sum, target tokens)] of the last step over all data-parallel ranks (fp64), or None."""
        if self.tasks is None:
            return None
        return self.dp_sum(total_over(self.cp, self.tasks.sums))

    # ---- one optimizer step ---------------------------------------------------------------------------
    def accumulation_context(self, is_last_micro_batch: bool):
        """Context for one micro-batch's forward+backward; data-parallel strategies skip gradient
        synchronization on all but the last micro-batch."""
        return nullcontext()

    def local_worker(self):
        """With independent replicas: this rank's trainer/parallel/sync.Worker (what it trains, the group of the
        workers); else None."""
        return None

    def forward_backward(self, micro_batches: List[dict], num_target_tokens: int,
                         grad_weight: float = 1.0) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches. The loss of the step is the sum of token
        cross-entropies over the global batch divided by its target-token count, so each micro-batch's sum is
        divided by the global count (never a mean of per-micro-batch means), times `grad_weight` (a local-SGD
        worker's gradient stands for all the workers'). Returns the local CE sum."""
        total = self.begin_step()
        for i, batch in enumerate(micro_batches):
            batch = {k: to_device(v, self.device) for k, v in batch.items()}
            with self.accumulation_context(i == len(micro_batches) - 1), sharded_or_whole(self.cp, batch) as batch:
                ce_sum, term = micro_batch_losses(self.model, batch, self.precision, self.tasks, self.router, self.cp,
                                                  self.objective)
                loss = ce_sum / num_target_tokens if grad_weight == 1.0 else ce_sum * grad_weight / num_target_tokens
                if term is not None:  # the mean of the micro-batches' terms over every data-parallel rank
                    loss = loss + term * (self.router.coef * grad_weight / (len(micro_batches) * self.dp_size))
                self.backward(loss)
            total += ce_sum.detach()
        return total_over(self.cp, total)

    def begin_step(self) -> torch.Tensor:
        """Reset the per-step sums (tasks, router terms); returns the step's zero CE total."""
        if self.tasks is not None:
            self.tasks.reset()
        if self.router is not None:
            self.router.reset()
        if self.objective is not None:
            self.objective.reset()
        return torch.zeros((), device=self.device)

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.scale(loss).backward()

    def grad_norm_and_clip(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the gradient (before clipping), clipping to `max_norm` when it is > 0."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        return clip_to_norm(params, grad_square_sum(p.grad for p in params).sqrt(), max_norm)

    def optimizer_step(self, max_norm: float):
        """Unscale, measure and clip the gradient, step (unless fp16 overflowed), zero. -> (norm, skipped)."""
        self.precision.unscale_(self.optimizer)
        norm = self.grad_norm_and_clip(max_norm)
        if self.skip_nonfinite and self.precision.scaler is None and not bool(torch.isfinite(norm)):
            # train.on_nonfinite=skip (fp16 leaves it to the loss scaler): no update from this batch. Reading the
            # norm waits for the step's gradients: the cost of this mode.
            self.optimizer.zero_grad(set_to_none=True)
            return norm, True
        skipped = self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return norm, skipped

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches: List[dict]) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for batch in micro_batches:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with sharded_or_whole(self.cp, batch) as batch:
                total += token_loss_sum(self.model, batch, self.precision, router=self.router,
                                        objective=self.objective)
        return total_over(self.cp, total)

    # ---- collectives over the data-parallel ranks ------------------------------------------------------
    def dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and self.dp_size > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.dp_group())
        return tensor

    def dp_group(self):
        return None  # the default group; strategies with model parallelism return their dp sub-group

    # ---- checkpoint state ---------------------------------------------------------------------------------
    def checkpoint_state(self, model_only: bool = False) -> dict:
        """The tensors a checkpoint holds, keyed by the unwrapped model's parameter names (DCP reshards them on
        load, so any world size and layout can read them). Optimizer hyper-parameters go separately."""
        options = self._state_dict_options()
        if model_only:
            return {"model": get_model_state_dict(self.model, options=options)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model_sd, "optim": _tensors_only(optim_sd["state"])}

    def _state_dict_options(self):
        """peft=lora: a checkpoint holds what trains (the adapters); the frozen base comes from the model's own
        weights again when a run resumes. Loading then sets only those (DCP has already refused a checkpoint that
        lacks one of them)."""
        if self.adapters is None:
            return None
        return StateDictOptions(ignore_frozen_params=True, strict=False)

    def local_state(self) -> dict:
        """State of this rank alone that the checkpoint keeps beside the shared tensors (a dict of tensors, saved
        as local/rank_<r>.pt): PowerSGD's error feedback, a local-SGD worker's own weights and optimizer state.
        Default: none."""
        return {}

    def load_local_state(self, state) -> str:
        """Restore `local_state` (None: the checkpoint has none for this rank, e.g. another world size). Returns a
        notice for the log when something starts afresh, else ""."""
        return ""

    def optimizer_param_groups(self) -> list:
        return get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]

    def save_checkpoint_state(self, folder: str, group, async_save: bool):
        """Write the model and optimizer tensors into `folder` (DCP, sharded per rank). Returns the future of
        an async save, else None."""
        state = self.checkpoint_state()
        # Local SGD / DiLoCo workers hold different values under one name: DCP writes each name from one of
        # the ranks that hold it, by default whichever has written least; the lowest rank, worker 0, here, so
        # the checkpoint's model is one worker's whole model, never a mix.
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=self.independent_replicas)
        if async_save:
            return dcp.async_save(state, checkpoint_id=folder, process_group=group, no_dist=group is None,
                                  planner=planner)
        dcp.save(state, checkpoint_id=folder, process_group=group, no_dist=group is None, planner=planner)
        return None

    def load_checkpoint_from(self, saved: SavedCheckpoint, group) -> None:
        folder, weights_only = saved.folder, saved.weights_only
        state = self.checkpoint_state(model_only=weights_only)
        dcp.load(state, checkpoint_id=folder, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(),
                 process_group=group, no_dist=group is None)
        self.load_checkpoint_state(state, None if weights_only else saved.param_groups)

    def load_checkpoint_state(self, state: dict, param_groups) -> None:
        options = self._state_dict_options()
        if param_groups is None:
            set_model_state_dict(self.model, state["model"], options=options)
            return
        groups = groups_by_name(param_groups, self.optimizer_param_groups())  # rank 0 saved them under its names
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optim"], "param_groups": groups}, options=options)

    # ---- the memory report (logging.memory_report: trainer/observe/) ----------------------------------------
    def watch_memory(self, snap) -> list:
        """Arm this backend's own probe points for the first step (trainer/observe/memory.py watches the optimizer
        step): call `snap(point_name)` where transient tensors exist. Returns the callables that disarm them."""
        return []

    def close(self) -> None:
        """Release the parallel model before the process group goes (wrappers that hold communication
        state, like DDP's reducer, can block in their destructor once the group is destroyed)."""
        self.model = None
        self.optimizer = None

    def full_tensors(self):
        """(name, full tensor) of every parameter (tied ones once) and persistent buffer of the model, real on
        rank 0 (other ranks may get empty tensors); collective where the model is sharded. Here: a model each
        rank holds whole, bitsandbytes' 4-bit weights dequantized."""
        return full_tensors(self.unwrapped())

def _tensors_only(tree):
    """Optimizer state without non-tensor leaves (an SGD momentum buffer of None, say)."""
    if isinstance(tree, dict):
        return {k: _tensors_only(v) for k, v in tree.items() if v is not None}
    return tree
