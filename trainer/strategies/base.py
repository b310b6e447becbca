"""The strategy interface. A strategy turns a model into a parallel model and owns backward, the optimizer
step, gradient-norm computation and state/export specifics. The training loop talks only to this interface.
"""
from __future__ import annotations

import os
import shutil
import sys
from contextlib import nullcontext
from typing import ClassVar, FrozenSet, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models.init import copy_full_tensors
from models.packing import PackedForward
from trainer.data.datasets import IGNORE


PACKED_FORWARD = PackedForward()  # one per process: the first packed batch checks the model


def token_loss_sum(model, batch: dict, precision, tasks=None) -> torch.Tensor:
    """Sum of next-token cross-entropies over the micro-batch's target tokens (fp32). With `tasks` (TaskLosses)
    and rows that carry their task (data.kind=mixture), each row's sum is also added to its task's."""
    with precision.autocast():
        if "position_ids" in batch:  # data.packing=documents: attention stays inside each packed document
            logits = PACKED_FORWARD(model, batch["input_ids"], batch["position_ids"]).logits
        else:
            logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    labels = batch["labels"]
    if tasks is None or "task" not in batch:
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                reduction="none").view(labels.shape)
    tasks.add(per_token.detach().sum(1), (labels != IGNORE).sum(1), batch["task"])
    return per_token.sum()


class TaskLosses:
    """Per-task token-loss sums and target-token counts of this rank's rows (data.kind=mixture), fp64."""

    def __init__(self, num_tasks: int, device: torch.device):
        self.sums = torch.zeros(num_tasks, 2, dtype=torch.float64, device=device)

    def add(self, row_losses: torch.Tensor, row_tokens: torch.Tensor, task: torch.Tensor) -> None:
        self.sums.index_add_(0, task.to(self.sums.device), torch.stack([row_losses.double(), row_tokens.double()], 1))

    def reset(self) -> None:
        self.sums.zero_()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch tensor onto the device without waiting for it: CUDA drains the stream before a copy from
    pageable memory, so the host could not queue the next micro-batch while the device computes; a copy from
    page-locked memory is queued like a kernel."""
    if device.type != "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class Strategy:
    name: ClassVar[str] = "base"
    # How launch.sh starts it: "python" (one process), "torchrun" or "deepspeed".
    launcher: ClassVar[str] = "torchrun"
    # Degrees (strategy.<key>) this strategy can use beyond 1.
    degrees: ClassVar[FrozenSet[str]] = frozenset()
    needs_process_group: ClassVar[bool] = True
    # True: the model is built without its pretrained weights, which come to load_initial_weights as a
    # models.weights.PretrainedWeights to read part by part; False: registry.build loads them.
    loads_pretrained_weights: ClassVar[bool] = False
    supports_compile: ClassVar[bool] = True
    uses_fsdp_options: ClassVar[bool] = False  # strategy.cpu_offload / param_dtype / reduce_dtype
    uses_zero_options: ClassVar[bool] = False  # strategy.zero_quantized_* / zero_hpz_partition_size (ZeRO++)
    uses_dtensor_parameters: ClassVar[bool] = False  # parameters are DTensors (optimizer kernels differ)
    # What save_checkpoint_state writes: checkpoints of one format are only read by strategies of the same.
    checkpoint_format: ClassVar[str] = "dcp"
    # strategy.fault_tolerance values this strategy runs with besides none.
    fault_tolerance: ClassVar[FrozenSet[str]] = frozenset()
    # strategy.comm_hook values this strategy can compress its gradient reduction with (besides none).
    comm_hooks: ClassVar[FrozenSet[str]] = frozenset()
    # Whether sync=local_sgd / diloco (strategies/sync.py) runs with this strategy (see periodic_sync_of).
    periodic_sync: ClassVar[bool] = False
    # Whether trainer/observe/comm_bytes.py sees every collective of a step (metrics.jsonl gets comm_bytes only then).
    counts_all_collectives: bool = True
    # peft.quantization=nf4 (QLoRA): bitsandbytes' 4-bit layers cannot be sharded or split, so only strategies that
    # hold the whole model on each rank take them.
    holds_whole_model: ClassVar[bool] = False

    def __init__(self, cfg, dims, device: torch.device, precision):
        self.cfg, self.dims, self.device, self.precision = cfg, dims, device, precision
        self.model = None
        self.optimizer = None
        self.skip_nonfinite = cfg.train.on_nonfinite == "skip"
        self.replicas = None  # torchft replica groups (strategies/replica_groups.py), attached by setup
        self.sync = None  # local SGD / DiLoCo (strategies/sync.py), attached by setup with sync != every_step
        self.tasks = None  # TaskLosses of the step in progress (data.kind=mixture; track_tasks)
        self.adapters = None  # peft=lora: models.lora.Adapters of the model (set before setup)
        self._step_tokens = None  # (this rank's token-loss sum, its target tokens, the global batch's) with replicas

    # ---- checks before any process group starts -------------------------------------------------------
    @classmethod
    def skips_nonfinite_steps(cls, cfg) -> bool:
        """Whether a step with a non-finite gradient can be skipped (train.on_nonfinite=skip)."""
        return True

    @classmethod
    def periodic_sync_of(cls, cfg) -> bool:
        """Whether sync=local_sgd / diloco runs with this strategy in this layout."""
        return cls.periodic_sync

    @classmethod
    def config_problems(cls, cfg, world_size: int) -> List[str]:
        problems = []
        for key in ("dp_replicate", "dp_shard", "tp", "pp"):
            value = getattr(cfg.strategy, key)
            if value not in (1, -1) and key not in cls.degrees_of(cfg.strategy.name):
                problems.append(f"strategy={cfg.strategy.name} does not use strategy.{key} (got {value}); set it to 1 "
                                f"or pick a strategy that does")
        if not cls.uses_fsdp_options:
            for key, unset in (("cpu_offload", False), ("param_dtype", None), ("reduce_dtype", None)):
                if getattr(cfg.strategy, key) != unset:
                    problems.append(f"strategy.{key}={getattr(cfg.strategy, key)} is an FSDP option; "
                                    f"strategy={cfg.strategy.name} does not use it: leave it unset"
                                    + (" (DeepSpeed: strategy.offload_optimizer / offload_param)"
                                       if key == "cpu_offload" else ""))
        from trainer.parallel.sync import sync_problems

        problems += sync_problems(cfg, cfg.strategy.name, cls.periodic_sync_of(cfg))
        ft = cfg.strategy.fault_tolerance
        if ft != "none" and ft not in cls.fault_tolerance_of(cfg):
            problems.append(f"strategy.fault_tolerance={ft} is not available with strategy={cfg.strategy.name}"
                            f"{' and tensor or pipeline parallelism' if ft in cls.fault_tolerance else ''}; use "
                            f"strategy=ddp or strategy=hsdp (replica groups), or strategy.fault_tolerance=none with "
                            f"train.max_restarts (restarts from the last checkpoint)")
        elif ft == "torchft":
            from trainer.parallel import replica_groups

            problems += replica_groups.config_problems(cfg)
        if not cls.uses_zero_options:
            from trainer.config.schema import ZERO_PLUS_PLUS_OFF

            for key, off in ZERO_PLUS_PLUS_OFF.items():
                if getattr(cfg.strategy, key) != off:
                    problems.append(f"strategy.{key} is a ZeRO++ option of strategy=zero3; strategy="
                                    f"{cfg.strategy.name} does not use it: leave it unset")
        hook = cfg.strategy.comm_hook
        if hook != "none" and hook not in cls.comm_hooks:
            problems.append(f"strategy.comm_hook={hook} is a DDP communication hook; strategy={cfg.strategy.name} "
                            f"cannot use it: use strategy=ddp, or strategy.reduce_dtype=bf16 with fsdp/hsdp "
                            f"(the gradient reduce-scatter in bf16), or leave strategy.comm_hook=none")
        from trainer.run.optim import implementation_problems

        problems += implementation_problems(cfg, cls.uses_dtensor_parameters)
        if cfg.train.on_nonfinite == "skip" and not cls.skips_nonfinite_steps(cfg):
            problems.append(f"train.on_nonfinite=skip is not available with strategy={cfg.strategy.name} and "
                            f"precision={cfg.precision.name} (the step is taken inside the engine); use "
                            f"train.on_nonfinite=stop, or precision=fp16, whose loss scaler skips such steps")
        if cfg.peft.name != "none":
            problems += cls.peft_problems(cfg)
        if cfg.train.compile:
            if not cls.supports_compile:
                problems.append(f"train.compile=true is not available with strategy={cfg.strategy.name}; set "
                                f"train.compile=false")
            else:
                problems += compile_problems(cfg.train.device)
        return problems

    @classmethod
    def peft_problems(cls, cfg) -> List[str]:
        """peft=lora with this strategy (and layout): [] where it runs."""
        from models.lora import quantization_problems

        if cfg.peft.quantization == "none":
            return []
        if not cls.holds_whole_model:
            return [f"peft.quantization={cfg.peft.quantization} (QLoRA) is available with strategy=single or ddp, "
                    f"which hold the 4-bit base whole on each rank (bitsandbytes' 4-bit weights are not sharded by "
                    f"strategy={cfg.strategy.name}); use one of them or peft.quantization=none"]
        from tessera.errors import ConfigError
        from trainer.parallel.dims import select_device

        try:
            device = select_device(cfg.train.device)
        except ConfigError:
            return []  # the device's own problem is reported with the train.* keys
        return quantization_problems(device)

    @classmethod
    def fault_tolerance_of(cls, cfg) -> FrozenSet[str]:
        """The strategy.fault_tolerance values (besides none) this configuration of the strategy runs with."""
        return cls.fault_tolerance

    @classmethod
    def preflight(cls, cfg) -> None:
        """Checks of what the run needs outside this job (raise a TesseraError), before any process group: a
        torchft lighthouse that cannot be reached is an error now, not a hang in the first quorum."""
        if cfg.strategy.fault_tolerance == "torchft":
            from trainer.parallel import replica_groups

            replica_groups.check_lighthouse(cfg.strategy)

    @classmethod
    def run_dir_for(cls, cfg, run_dir: str) -> str:
        """The run directory of this job under the launch's output folder (a folder per torchft replica group)."""
        from trainer.parallel import replica_groups

        return replica_groups.group_run_dir(cfg, run_dir)

    @classmethod
    def degrees_of(cls, name: str) -> FrozenSet[str]:
        """The degrees strategy `name` (one of the names this class serves) can use beyond 1."""
        return cls.degrees

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
    def model_construction(self, pretrained: bool):
        """Context in which the model is built (and pretrained weights loaded); sharding strategies make each
        rank hold only its part from the start."""
        return nullcontext()

    def setup(self, model, build_optimizer, initial_weights=None):
        """Parallelize `model`, write `initial_weights` into it (preset models: an iterable of
        {name: full tensor} per init unit, see models/init.py; None for pretrained weights, already loaded), and
        create its optimizer with `build_optimizer(named_parameters)`."""
        raise NotImplementedError

    def prepare_blocks(self, model) -> None:
        """Activation checkpointing, then compile, on the decoder blocks: each strategy's setup calls it once the
        blocks are what they will compute with (after tensor parallelism, before FSDP or another wrapper)."""
        apply_activation_checkpointing(model, self.cfg.train)
        apply_compile(model, self.cfg.train)

    def load_initial_weights(self, model, initial_weights) -> None:
        """Write full tensors into a model that each rank holds whole; sharding strategies override this to
        write only their shards."""
        if initial_weights is not None:
            copy_full_tensors(model, initial_weights)

    def unwrapped(self):
        """The plain Hugging Face model (its parameters may be sharded in other strategies)."""
        return self.model

    # ---- fault-tolerant replica groups (strategy.fault_tolerance=torchft: strategies/replica_groups.py) ---------
    def attach_replica_groups(self) -> None:
        """End of setup, for strategies whose class lists torchft in `fault_tolerance`: join the replica groups
        and share the model, optimizer and loss-scaler state with a recovering group."""
        from trainer.parallel import replica_groups

        if self.cfg.strategy.fault_tolerance != "torchft":
            return
        self.replicas = replica_groups.ReplicaGroups(self.cfg, self.device)
        model = self.unwrapped()
        self.share_state("model", lambda: replica_groups.local_tensors(model.state_dict()),
                         lambda state: replica_groups.copy_into_module(model, state))
        self.share_state("optimizer", lambda: replica_groups.local_optimizer_state(self.optimizer),
                         lambda state: replica_groups.load_optimizer_state(self.optimizer, state))
        self.share_state("precision", self.precision.state_dict, self.precision.load_state_dict)

    def share_state(self, key: str, state_dict, load_state_dict) -> None:
        """Run state beyond the model and optimizer (scheduler, counters) that a recovering replica group copies
        from a live one with them; without replica groups nothing to do."""
        if self.replicas is not None:
            self.replicas.share_state(key, state_dict, load_state_dict)

    def begin_step(self, step: int) -> None:
        """Before step `step`'s batch is read (replica groups: the quorum, and a recovering group's state copied
        from a live one, which may move the run's step)."""
        if self.replicas is not None:
            self.replicas.begin_step(step)

    def committed(self) -> bool:
        """Whether the last optimizer_step was taken; False: the loop runs the same step again."""
        return self.replicas is None or self.replicas.committed

    def trained_tokens(self, num_target_tokens: int) -> int:
        """Target tokens the last step trained on (fewer than the global batch's while a replica group is down)."""
        return num_target_tokens if self.replicas is None else int(self.replicas.tokens)

    def step_loss(self, loss_sum: torch.Tensor, num_target_tokens: int) -> float:
        """The last step's loss: token cross-entropy over the tokens it trained on (a collective, on log steps)."""
        if self.replicas is not None:
            return self.replicas.loss_sum / max(self.replicas.tokens, 1.0)
        return self.dp_sum(loss_sum).item() / num_target_tokens

    def track_tasks(self, num_tasks: int) -> None:
        """Keep per-task loss sums of every step (data.kind=mixture: each batch row carries its task)."""
        self.tasks = TaskLosses(num_tasks, self.device)

    def task_sums(self):
        """[task, (token-loss sum, target tokens)] of the last step over all data-parallel ranks (fp64), or None."""
        return None if self.tasks is None else self.dp_sum(self.tasks.sums)

    def step_metrics(self) -> dict:
        """Extra fields for the step's metrics record."""
        return {} if self.replicas is None else {"replica_groups": self.replicas.participants}

    def _reduce_across_replica_groups(self) -> bool:
        """Replica groups: sum the live groups' gradients (normalised by the tokens they trained) -> whether the
        step may be taken."""
        loss_sum, tokens, n_target = self._step_tokens
        grads = [p.grad for p in self.unwrapped().parameters() if p.grad is not None]
        self.replicas.reduce(grads, loss_sum, tokens, n_target)
        return self.replicas.commit()

    # ---- one optimizer step ---------------------------------------------------------------------------
    def accumulation_context(self, is_last_micro_batch: bool):
        """Context for one micro-batch's forward+backward; data-parallel strategies skip gradient
        synchronization on all but the last micro-batch."""
        return nullcontext()

    def forward_backward(self, micro_batches: List[dict], num_target_tokens: int) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches. The loss of the step is the sum of token
        cross-entropies over the global batch divided by its target-token count, so each micro-batch's sum is
        divided by the global count (never a mean of per-micro-batch means). Returns the local CE sum."""
        total = torch.zeros((), device=self.device)
        scale = self.sync.loss_scale() if self.sync is not None else 1.0
        if self.tasks is not None:
            self.tasks.reset()
        for i, batch in enumerate(micro_batches):
            batch = {k: to_device(v, self.device) for k, v in batch.items()}
            with self.accumulation_context(i == len(micro_batches) - 1):
                ce_sum = token_loss_sum(self.model, batch, self.precision, self.tasks)
                # a local-SGD / DiLoCo worker's gradient stands for all the workers' (strategies/sync.py)
                self.backward(ce_sum / num_target_tokens if scale == 1.0 else ce_sum * scale / num_target_tokens)
            total += ce_sum.detach()
        if self.replicas is not None:
            tokens = sum(int((b["labels"] != IGNORE).sum()) for b in micro_batches)
            self._step_tokens = (total, tokens, num_target_tokens)
        return total

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.scale(loss).backward()

    def grad_norm_and_clip(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the gradient (before clipping), clipping to `max_norm` when it is > 0."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        return clip_to_norm(params, grad_square_sum(p.grad for p in params).sqrt(), max_norm)

    def optimizer_step(self, max_norm: float):
        """Unscale, measure and clip the gradient, step (unless fp16 overflowed), zero. -> (norm, skipped)."""
        if self.replicas is not None and not self._reduce_across_replica_groups():
            self.optimizer.zero_grad(set_to_none=True)
            return torch.zeros((), dtype=torch.float64), False
        self.precision.unscale_(self.optimizer)
        norm = self.grad_norm_and_clip(max_norm)
        if self.skip_nonfinite and self.precision.scaler is None and not bool(torch.isfinite(norm)):
            # train.on_nonfinite=skip (fp16 leaves it to the loss scaler): no update from this batch. Reading the
            # norm waits for the step's gradients: the cost of this mode.
            self.optimizer.zero_grad(set_to_none=True)
            return norm, True
        skipped = self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.sync is not None:
            self.sync.after_step()
        return norm, skipped

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches: List[dict]) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for batch in micro_batches:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            total += token_loss_sum(self.model, batch, self.precision)
        return total

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
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        options = self._state_dict_options()
        if model_only:
            return {"model": get_model_state_dict(self.model, options=options)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model_sd, "optim": _tensors_only(optim_sd["state"])}

    def _state_dict_options(self):
        """peft=lora: a checkpoint holds what trains (the adapters); the frozen base comes from the model's own
        weights again when a run resumes. Loading then sets only those (DCP has already refused a checkpoint that
        lacks one of them)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if self.adapters is None:
            return None
        return StateDictOptions(ignore_frozen_params=True, strict=False)

    def local_state(self) -> dict:
        """State of this rank alone that the checkpoint keeps beside the shared tensors (a dict of tensors, saved
        as local/rank_<r>.pt): PowerSGD's error feedback, a local-SGD worker's own weights. Default: none."""
        return {}

    def load_local_state(self, state) -> str:
        """Restore `local_state` (None: the checkpoint has none for this rank, e.g. another world size). Returns a
        notice for the log when something starts afresh, else ""."""
        return ""

    def optimizer_param_groups(self) -> list:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]

    def save_checkpoint_state(self, folder: str, group, async_save: bool):
        """Write the model and optimizer tensors into `folder` (DCP, sharded per rank). Returns the future of
        an async save, else None."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner

        state = self.checkpoint_state()
        # Local SGD / DiLoCo workers hold different values under one name: DCP writes each name from one of
        # the ranks that hold it, by default whichever has written least; the lowest rank, worker 0, here, so
        # the checkpoint's model is one worker's whole model, never a mix.
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=self.sync is not None)
        if async_save:
            return dcp.async_save(state, checkpoint_id=folder, process_group=group, no_dist=group is None,
                                  planner=planner)
        dcp.save(state, checkpoint_id=folder, process_group=group, no_dist=group is None, planner=planner)
        return None

    def load_checkpoint_from(self, folder: str, group, weights_only: bool, param_groups) -> None:
        import torch.distributed.checkpoint as dcp

        from trainer.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner

        state = self.checkpoint_state(model_only=weights_only)
        dcp.load(state, checkpoint_id=folder, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(),
                 process_group=group, no_dist=group is None)
        self.load_checkpoint_state(state, None if weights_only else param_groups)

    def load_checkpoint_state(self, state: dict, param_groups) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        options = self._state_dict_options()
        if param_groups is None:
            set_model_state_dict(self.model, state["model"], options=options)
            return
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optim"], "param_groups": self._my_groups(param_groups)},
                       options=options)

    def _my_groups(self, saved: list) -> list:
        """The saved param groups' hyper-parameters under this rank's parameter names. Rank 0 wrote the groups
        with its own names; where ranks hold different parameters (pipeline stages) a group is matched by a
        shared name, else by its weight decay (the only hyper-parameter that tells Tessera's groups apart)."""
        mine = self.optimizer_param_groups()
        out = []
        for group in mine:
            names = set(group["params"])
            match = next((g for g in saved if names & set(g["params"])), None)
            if match is None:
                match = next((g for g in saved if g.get("weight_decay") == group.get("weight_decay")), group)
            out.append(dict(match, params=list(group["params"])))
        return out

    # ---- model-state memory (logging.memory_report: trainer/observe/memory.py gathers and logs what strategies state) ---
    def model_state_bytes(self) -> dict:
        """Bytes this rank holds now per category (trainer.observe.memory.CATEGORIES: params, master_params, optimizer,
        grads, gathered), read through public APIs: the model's parameters and their `.grad` (a DTensor counts its
        local shard), the tensors in the optimizer's `state`. Called only for the memory report."""
        count = StateBytes()
        params = list(self.unwrapped().parameters())
        for p in params:
            count.add("params", p)
        count.add_optimizer_state(self.optimizer)
        for p in params:
            count.add("grads", p.grad)
        return count.bytes

    def watch_memory(self, snap) -> list:
        """Arm this backend's own probe points for the first step (trainer/observe/memory.py watches the optimizer step):
        call `snap(point_name)` where transient tensors exist. Returns the callables that disarm them."""
        return []

    def memory_layout(self) -> dict:
        """Extra top-level entries for memory.json that explain the figures (FSDP2: shard group, unit sizes)."""
        return {}

    def built_parameter_bytes(self, model) -> int:
        """Bytes of the parameters this rank holds right after model construction (a sharded build: its part)."""
        count = StateBytes()
        for p in model.parameters():
            count.add("params", p)
        return count.bytes["params"]

    # ---- the planner (trainer/planner/): this strategy's per-rank model states, from the config alone ----------
    @classmethod
    def estimate_model_states(cls, est, cfg, dims, counts, rank_params: float) -> None:
        """Fill `est` (a trainer.planner.estimate.Estimate: params, grads, optimizer, master_params, buffers, host_params,
        host_load, notes) in bytes for the heaviest rank; `counts` are the model's parameter counts
        (trainer.planner.estimate.Counts), `rank_params` the parameters a rank's model-parallel part holds. Default: a whole
        fp32 replica per rank with its gradients and optimizer state (single, ddp)."""
        from trainer.planner.estimate import is_pretrained, optimizer_bytes_per_param

        psi = counts.total
        est.params, est.grads, est.optimizer = 4 * psi, 4 * psi, optimizer_bytes_per_param(cfg) * psi
        est.host_load = 4 * psi * (2 if is_pretrained(cfg) else 1)

    def close(self) -> None:
        """Release the parallel model before the process group goes (wrappers that hold communication
        state, like DDP's reducer, can block in their destructor once the group is destroyed)."""
        if self.replicas is not None:
            self.replicas.close()
            self.replicas = None
        self.model = None
        self.optimizer = None

    # ---- export -----------------------------------------------------------------------------------------
    def export_hf(self, out_dir: str, tokenizer, adapter_dir: Optional[str] = None) -> List[str]:
        """Write the model as Hugging Face safetensors + config + tokenizer into `out_dir`, atomically
        (a temporary folder renamed into place). peft=lora: the merged model there, and the adapter alone into
        `adapter_dir` when given. Rank 0 writes; every rank must call. Returns the folders written."""
        if self.adapters is not None:
            return self.write_exports(self.unwrapped().config, tokenizer, out_dir, adapter_dir,
                                      self.full_tensors())
        if not dist.is_initialized() or dist.get_rank() == 0:
            from trainer.exporting.hf_folder import write_hf_folder

            write_hf_folder(self.unwrapped(), tokenizer, out_dir, dtype=self.cfg.export.dtype)
        if dist.is_initialized():
            dist.barrier()
        return [out_dir]

    def full_tensors(self):
        """(name, full tensor) of every parameter (tied ones once) and persistent buffer of the model, real on
        rank 0 (other ranks may get empty tensors); collective where the model is sharded. Here: a model each
        rank holds whole, bitsandbytes' 4-bit weights dequantized."""
        from models.lora import full_tensors

        return full_tensors(self.unwrapped())

    def write_exports(self, config, tokenizer, out_dir: str, adapter_dir: Optional[str], named) -> List[str]:
        """The merged model streamed into `out_dir` from `named` (full_tensors), the adapter into `adapter_dir`."""
        from trainer.exporting.hf_folder import dense_config, write_adapter_folder, write_hf_folder_streaming

        writer = not dist.is_initialized() or dist.get_rank() == 0
        adapter = {}
        write_hf_folder_streaming(dense_config(config), tokenizer, out_dir, self.adapters.export_streams(named, adapter), writer,
                                  dtype=self.cfg.export.dtype)
        if writer and adapter_dir:
            write_adapter_folder(self.adapters, adapter_dir, adapter, self.cfg.model.name_or_path)
        if dist.is_initialized():
            dist.barrier()
        return [out_dir] + ([adapter_dir] if adapter_dir else [])


class StateBytes:
    """Bytes per memory-report category, each tensor counted once by its own bytes (numel x element size; a
    DTensor by its local shard): views of one buffer count what they cover, a buffer's unused rest is not seen."""

    def __init__(self):
        from trainer.observe.memory import CATEGORIES

        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.seen = set()

    def add(self, category: str, tensor) -> None:
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta" or tensor.numel() == 0:
            return
        key = (tensor.device, tensor.data_ptr(), tensor.numel(), tensor.dtype)
        if key not in self.seen:
            self.seen.add(key)
            self.bytes[category] += tensor.numel() * tensor.element_size()

    def add_optimizer_state(self, optimizer) -> None:
        """The tensors in a torch optimizer's public `state` (AdamW: exp_avg, exp_avg_sq, step)."""
        for state in (optimizer.state.values() if optimizer is not None else ()):
            for value in state.values():
                self.add("optimizer", value)


def apply_activation_checkpointing(model, train_cfg) -> None:
    """Hugging Face's non-reentrant activation checkpointing of every k-th decoder block."""
    if train_cfg.activation_checkpointing == "full":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=train_cfg.activation_checkpointing_every)


def apply_compile(model, train_cfg) -> None:
    """torch.compile per decoder block (inductor)."""
    from models.init import decoder_blocks

    if train_cfg.compile:
        for _, block in decoder_blocks(model):
            block.compile()


def grad_square_sum(grads) -> torch.Tensor:
    """Sum of the squared entries of this rank's gradient tensors (their local parts, for DTensors), accumulated
    in fp64: an fp32 sum drifts by ~1e-4 relative over a large embedding, so strategies would disagree on the norm
    and on clipping. A DTensor's part counts 1/(its replicas): summed over every rank (world_square_sum), each
    entry of the whole gradient then counts once, whatever the mesh."""
    from torch.distributed.tensor import DTensor

    total = None
    groups = {}
    for g in grads:
        replicas = 1
        if isinstance(g, DTensor):
            for dim, placement in enumerate(g.placements):
                if placement.is_replicate():
                    replicas *= g.device_mesh.size(dim)
            g = g.to_local()
        if g.numel():
            groups.setdefault(replicas, []).append(g)
    # torch._foreach_norm: per-tensor norms with an fp64 result in one kernel; no public function returns those.
    for replicas, local in groups.items():  # stays on the gradients' device: no host sync in the step
        sq = torch.stack(torch._foreach_norm(local, 2.0, dtype=torch.float64)).pow(2).sum() / replicas
        total = sq if total is None else total + sq.to(total.device)
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def world_square_sum(grads, device: torch.device, group=None) -> torch.Tensor:
    """grad_square_sum over every rank (one all-reduce): the squared norm of the whole model's gradient when
    each rank holds a part of it (shards, stages), each DTensor part weighted by 1/(its replicas). (An all-reduce
    over the mesh dimensions the gradient is split over would be fewer bytes, but FSDP2's 2-D (shard x tp) mesh
    gives groups that miss ranks on gloo: measured, the norm came out ~30% low.) `group`: only over its ranks (a
    local-SGD worker's own gradient)."""
    sq = grad_square_sum(grads).to(device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return sq


def clip_to_norm(params, norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale the gradients of `params` so that their global norm `norm` is at most `max_norm` (> 0)."""
    if max_norm > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.float())
    return norm


def compile_problems(device_spec: str) -> List[str]:
    """Whether torch.compile (inductor) can run here: dynamo on this Python, Triton for CUDA, a C++ compiler
    for the CPU."""
    if not torch._dynamo.is_dynamo_supported():  # torch offers this check only under torch._dynamo
        return ["train.compile=true: torch.compile does not support this Python/platform; set train.compile=false"]
    cuda = device_spec.startswith("cuda") or (device_spec == "auto" and torch.cuda.is_available())
    if cuda:
        from torch.utils._triton import has_triton  # inductor's own check (usable Triton for this device)

        if not has_triton():
            return ["train.compile=true needs Triton on CUDA, which is not installed; set train.compile=false or "
                    "install triton"]
        return []
    # Inductor runs exactly $CXX (default g++, clang++ on macOS), with no fallback to another compiler
    # (torch._inductor.config.cpp.cxx); with TORCH_INDUCTOR_INSTALL_GXX it may fetch g++ from conda itself.
    cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    if not shutil.which(cxx) and not os.environ.get("TORCH_INDUCTOR_INSTALL_GXX"):
        return [f"train.compile=true on the CPU needs the C++ compiler {cxx!r} ($CXX, default g++), which is not "
                f"on PATH; install it, point CXX at one, or set train.compile=false"]
    return []


def _tensors_only(tree):
    """Optimizer state without non-tensor leaves (an SGD momentum buffer of None, say)."""
    if isinstance(tree, dict):
        return {k: _tensors_only(v) for k, v in tree.items() if v is not None}
    return tree
