"""DeepSpeed ZeRO stages 1, 2 and 3 (and offload) over deepspeed.initialize.

The DeepSpeed config is generated from the Hydra config; a user's own JSON (`strategy.deepspeed_config`) is
merged in: HF-style "auto" values are filled from the Hydra config, explicit values that contradict it are a
config error naming both keys. The optimizer and lr schedule stay Tessera's (the same as on every backend), so
an "optimizer" or "scheduler" section of a user's JSON only has its "auto" values checked and is then left out.

Numbers: DeepSpeed scales each micro-batch loss by 1/accumulation and averages gradients over the
data-parallel ranks. Tessera's micro-batch loss is already its share of the global token-normalized loss, so
backward runs with `scale_wrt_gas=False` on the loss times the data-parallel degree: the reduced gradient is
then exactly the global batch's gradient.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
from dataclasses import replace
from importlib.metadata import version
from types import SimpleNamespace
from typing import List

import torch
import torch.distributed as dist

from models.init import named_tensors
from tessera.errors import CheckpointError, ConfigError, one_line
from trainer.checkpoint.safe_load import checked_deepspeed_folder
from trainer.checkpoint.saved import SavedCheckpoint
from trainer.config.schema import ZERO_PLUS_PLUS_OFF
from trainer.data.store import file_lock
from trainer.launch import ds_ops
from trainer.run.loss import micro_batch_losses, to_device
from trainer.run.precision import DTYPES, Precision, cast_buffers_in_model_dtype
from trainer.strategies.base import Strategy
from trainer.strategies.capabilities import FLAT_PARTITIONS, Capabilities

STAGES = {"zero1": 1, "zero2": 2, "zero3": 3, "zero3_offload": 3}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _read_user_json(path: str) -> dict:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as e:
        raise ConfigError([f"strategy.deepspeed_config={path!r}: cannot read it ({e.strerror or one_line(e)})"]) \
            from None
    except ValueError as e:
        raise ConfigError([f"strategy.deepspeed_config={path!r} is not valid JSON: {one_line(e)}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"strategy.deepspeed_config={path!r} must hold a JSON object"])
    return data


def _is_auto(v) -> bool:
    return isinstance(v, str) and v == "auto"


class _UserJson:
    """The user's DeepSpeed JSON (strategy.deepspeed_config, or none) read against Hydra's values: the problems
    found, each naming the JSON key and the Hydra key it contradicts."""

    def __init__(self, path: str):
        self.data = _read_user_json(path) if path else {}
        self.src = f"strategy.deepspeed_config ({os.path.basename(path)})" if path else ""
        self.problems: List[str] = []

    def take(self, key_path: str, ours, hydra_key: str, equal=None):
        """Ours, after checking that the user's explicit value at key_path (dotted), if any, agrees with it."""
        node = self.data
        parts = key_path.split(".")
        for p in parts[:-1]:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if not isinstance(node, dict) or parts[-1] not in node or _is_auto(node[parts[-1]]):
            return ours
        theirs = node[parts[-1]]
        if not (equal(theirs, ours) if equal else theirs == ours):
            self.problems.append(f"{self.src}: {key_path}={theirs!r} contradicts {hydra_key}={ours!r}; change one of "
                                 f"them (or write \"auto\" in the JSON)")
        return ours

    def section(self, name: str) -> dict:
        value = self.data.get(name, {})
        return value if isinstance(value, dict) else {}


def build_ds_config(cfg, dp_size: int) -> tuple:
    """(DeepSpeed config dict, problems). Hydra's values win where the user's JSON says "auto" or is silent;
    a contradiction is a problem naming both keys."""
    t = cfg.train
    user = _UserJson(cfg.strategy.deepspeed_config)
    accum = t.global_batch_size // max(1, t.micro_batch_size * dp_size)
    _check_batch_and_precision(user, cfg, accum)
    _check_json_types(user)
    zero_user = _user_zero_section(user, cfg)
    offload = _offload_devices(cfg.strategy, zero_user)
    zero = _zero_section(user, cfg, zero_user, offload)
    _check_optimizer_params(user, cfg)
    ds = _ds_dict(user, cfg, accum, zero)
    if user.data and "zero_optimization" in user.data:
        user.problems += _zero_section_problems(zero, user.src)
    return ds, user.problems


def _check_batch_and_precision(user: _UserJson, cfg, accum: int) -> None:
    t, precision = cfg.train, cfg.precision.name
    user.take("train_batch_size", t.global_batch_size, "train.global_batch_size")
    user.take("train_micro_batch_size_per_gpu", t.micro_batch_size, "train.micro_batch_size")
    user.take("gradient_accumulation_steps", accum,
              "the accumulation derived from train.global_batch_size / (micro batch x data-parallel degree)")
    user.take("gradient_clipping", t.grad_clip, "train.grad_clip", equal=lambda a, b: float(a) == float(b))
    for name in ("fp16", "bf16"):
        user.take(f"{name}.enabled", precision == name, f"precision={precision} ({name}.enabled)",
                  equal=lambda a, b: bool(a) == b)


def _check_json_types(user: _UserJson) -> None:
    """Wrong JSON types are problems naming the JSON key (DeepSpeed itself would fail later with a traceback);
    a section that is not an object is left out."""
    for section in ("zero_optimization", "amp", "fp16", "bf16", "optimizer", "scheduler"):
        if section in user.data and not isinstance(user.data[section], dict):
            user.problems.append(f"{user.src}: {section}={user.data[section]!r} must be a JSON object ({{...}})")
            user.data = {k: v for k, v in user.data.items() if k != section}
    optimizer = user.data.get("optimizer")
    if isinstance(optimizer, dict) and not isinstance(optimizer.get("params", {}), dict):
        user.problems.append(f"{user.src}: optimizer.params={optimizer['params']!r} must be a JSON object ({{...}})")
    amp_on = user.data.get("amp", {}).get("enabled")
    if amp_on and not _is_auto(amp_on):
        user.problems.append(f"{user.src}: amp.enabled is not supported; use precision=bf16 or precision=fp16")


def _user_zero_section(user: _UserJson, cfg) -> dict:
    """The JSON's zero_optimization: its stage checked against the strategy's, legacy offload spellings read,
    offload entries that are not objects left out."""
    s, src = cfg.strategy, user.src
    zero_user = dict(user.data.get("zero_optimization", {}))
    theirs = zero_user.get("stage", "auto")
    if not _is_auto(theirs):
        if isinstance(theirs, bool) or not isinstance(theirs, int) or theirs not in (0, 1, 2, 3):
            user.problems.append(f"{src}: zero_optimization.stage={theirs!r} must be one of 0, 1, 2, 3 (a number, or "
                                 f"\"auto\"); strategy={s.name} uses stage {s.zero_stage}")
        elif theirs != s.zero_stage:
            user.problems.append(f"{src}: zero_optimization.stage={theirs} contradicts strategy={s.name} "
                                 f"(stage {s.zero_stage}); pick the strategy that matches the JSON")
    for legacy, key in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param")):
        if zero_user.get(legacy) is True and key not in zero_user:  # legacy spellings DeepSpeed still reads
            zero_user[key] = {"device": "cpu"}
        zero_user.pop(legacy, None)
    for key in ("offload_optimizer", "offload_param"):
        if key in zero_user and not isinstance(zero_user[key], dict):
            user.problems.append(f"{src}: zero_optimization.{key}={zero_user[key]!r} must be a JSON object such as "
                                 f"{{\"device\": \"cpu\"}}")
            zero_user.pop(key)
    return zero_user


def _offload_devices(s, zero_user: dict) -> dict:
    """{offload_optimizer, offload_param} -> device: Tessera's keys, else the JSON's."""
    out = {}
    for key in ("offload_optimizer", "offload_param"):
        out[key] = getattr(s, key)
        if key in zero_user and out[key] == "none":
            out[key] = zero_user[key].get("device", "none")
    return out


def _zero_section(user: _UserJson, cfg, zero_user: dict, offload: dict) -> dict:
    """zero_optimization as DeepSpeed gets it: the JSON's, with the stage, ZeRO++, buckets and offload set."""
    s, stage = cfg.strategy, cfg.strategy.zero_stage
    zero = dict(zero_user)
    zero["stage"] = stage
    _zero_plus_plus(user, cfg, zero)
    zero.setdefault("overlap_comm", s.overlap_comm)
    zero.setdefault("contiguous_gradients", True)
    for key, ours in (("reduce_bucket_size", s.reduce_bucket_size), ("allgather_bucket_size", s.allgather_bucket_size),
                      ("stage3_prefetch_bucket_size", s.stage3_prefetch_bucket_size),
                      ("stage3_param_persistence_threshold", s.stage3_param_persistence_threshold)):
        if key.startswith("stage3") and stage != 3:
            zero.pop(key, None)
            continue
        if key not in zero or _is_auto(zero[key]):
            zero[key] = int(ours)
    _offload_entries(user, s, zero, offload)
    return zero


def _zero_plus_plus(user: _UserJson, cfg, zero: dict) -> None:
    """ZeRO++ (quantised weight all-gather, quantised gradient reduction, hierarchical partitions): Tessera's keys
    or the JSON's; on the CPU DeepSpeed has none of their kernels. And the 1-bit optimizers DeepSpeed dropped."""
    s = cfg.strategy
    for key, off in ZERO_PLUS_PLUS_OFF.items():
        if getattr(s, key) != off:
            zero[key] = getattr(s, key)
    zeropp = [k for k, off in ZERO_PLUS_PLUS_OFF.items() if zero.get(k, off) not in (off, "auto")]
    if zeropp:
        if s.zero_stage != 3:
            user.problems.append(f"ZeRO++ ({', '.join(zeropp)}) needs ZeRO stage 3; use strategy=zero3")
        if _on_cpu(cfg):
            user.problems.append(f"ZeRO++ ({', '.join(zeropp)}: strategy.{zeropp[0]} or the JSON's "
                                 f"zero_optimization) needs CUDA devices (DeepSpeed's quantisation kernels); set it "
                                 f"off on the CPU")
    opt_type = str(user.section("optimizer").get("type", ""))
    if opt_type.replace("_", "").lower() in ("onebitadam", "zerooneadam", "onebitlamb"):
        user.problems.append(f"{user.src}: optimizer.type={opt_type}: DeepSpeed {_ds_version()} no longer ships its "
                             f"1-bit optimizers; use optim=adamw (compress the reduction with ZeRO++ on CUDA, or "
                             f"with strategy=ddp strategy.comm_hook=powersgd)")


def _offload_entries(user: _UserJson, s, zero: dict, offload: dict) -> None:
    for key, device in offload.items():
        if device == "none":
            zero.pop(key, None)
            continue
        zero[key] = dict(zero.get(key, {}), device=device)
        if device == "nvme":
            zero[key].setdefault("nvme_path", s.nvme_path)
    opt, param = offload["offload_optimizer"], offload["offload_param"]
    if param != "none" and s.zero_stage != 3:
        user.problems.append(f"parameter offload (strategy.offload_param={param}) needs ZeRO stage 3; use "
                             f"strategy=zero3 or zero3_offload")
    if opt != "none" and s.zero_stage == 0:
        user.problems.append("strategy.offload_optimizer needs ZeRO stage 1, 2 or 3")
    if "nvme" in (opt, param) and not s.nvme_path:
        user.problems.append("NVMe offload needs strategy.nvme_path=<a folder on a fast local disk>")


def _check_optimizer_params(user: _UserJson, cfg) -> None:
    """Tessera's optimizer is used on every backend: the JSON's optimizer.params may only agree with optim.*."""
    ours = {"lr": cfg.optim.lr, "weight_decay": cfg.optim.weight_decay, "betas": list(cfg.optim.betas),
            "eps": cfg.optim.eps}
    params = user.section("optimizer").get("params", {})
    params = params if isinstance(params, dict) else {}
    for k, value in ours.items():
        if k in params and not _is_auto(params[k]) and params[k] != value:
            user.problems.append(f"{user.src}: optimizer.params.{k}={params[k]!r} contradicts optim.{k}={value!r}; "
                                 f"Tessera's optimizer is used on every backend, so set optim.{k} instead")


def _ds_dict(user: _UserJson, cfg, accum: int, zero: dict) -> dict:
    t, precision = cfg.train, cfg.precision.name
    ds = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": float(t.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if precision == "fp16":
        ds["fp16"].update({k: v for k, v in user.section("fp16").items() if k != "enabled" and not _is_auto(v)})
        ds["fp16"].setdefault("initial_scale_power", int(round(math.log2(cfg.precision.init_scale))))
        ds["fp16"].setdefault("loss_scale_window", cfg.precision.growth_interval)
        ds["fp16"].setdefault("loss_scale", 0)
    for key in ("activation_checkpointing", "flops_profiler", "comms_logger", "aio", "communication_data_type"):
        if key in user.data:
            ds[key] = user.data[key]
    return ds


def _on_cpu(cfg) -> bool:
    return cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available())


def _ds_version() -> str:
    return version("deepspeed")


def _zero_section_problems(zero: dict, src: str) -> List[str]:
    """The merged zero_optimization section checked by DeepSpeed's own schema (types, allowed values, unknown
    keys), so a wrong value is one problem naming the JSON key instead of DeepSpeed's traceback at start-up."""
    import pydantic  # ZeRO runs only (start-up)
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # ZeRO runs only (start-up)

    try:
        DeepSpeedZeroConfig(**zero)
    except pydantic.ValidationError as e:
        out = []
        for err in e.errors():
            where = ".".join(str(p) for p in ("zero_optimization",) + tuple(err.get("loc", ())))
            out.append(f"{src}: {where}={err.get('input')!r}: {err.get('msg')}")
        return out
    except (TypeError, ValueError) as e:
        return [f"{src}: zero_optimization is not valid for DeepSpeed: {one_line(e)}"]
    return []


def unlink_shared_memory_buffer() -> None:
    """DeepSpeed's CPU all-reduce maps one shared-memory file per rank (/dev/shm/deepspeed_allreduce_buffer_
    <uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>) and never removes it: ~66 MB leaked per rank and run. Once every
    rank has mapped its peers' files (DeepSpeed's backend start-up, done before the barrier), each rank
    unlinks its own; the mappings live on until the process ends."""
    path = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    dist.barrier()  # every rank calls this: all have mapped their peers' files by now
    if not os.path.exists(path):
        return
    try:
        os.unlink(path)
    except OSError:
        pass


class DeepSpeedStrategy(Strategy):
    name = "zero"
    names = tuple(STAGES)
    capabilities = Capabilities(launcher="deepspeed", degrees=frozenset({"dp_replicate"}), zero_options=True,
                                checkpoint_format="deepspeed", compile=False)

    def __init__(self, cfg, dims, device, precision):
        # DeepSpeed runs bf16/fp16 itself (half weights, fp32 master copy, its loss scaler): no autocast on top.
        super().__init__(cfg, dims, device, Precision(SimpleNamespace(precision=SimpleNamespace(name="fp32")), device))
        ds_ops.ensure_ready(cfg)  # stale build lock: exit 2; a build says so

    @classmethod
    def optimizer_parameters(cls, cfg, dims) -> str:
        """ZeRO (every stage) hands the client optimizer flat 1-D fp32 partitions of all parameters."""
        return FLAT_PARTITIONS

    @classmethod
    def capabilities_for(cls, cfg) -> Capabilities:
        # the engine steps itself; only its fp16 overflow check skips a step
        return replace(cls.capabilities, skips_nonfinite_steps=cfg.precision.name == "fp16")

    @classmethod
    def layout_problems(cls, cfg, world_size: int) -> List[str]:
        problems = []
        s = cfg.strategy
        if s.zero_stage != STAGES[s.name]:
            problems.append(f"strategy.zero_stage={s.zero_stage} contradicts strategy={s.name} "
                            f"(stage {STAGES[s.name]}); leave strategy.zero_stage as the group sets it")
        for key in ("offload_optimizer", "offload_param"):
            if getattr(s, key) not in OFFLOAD_DEVICES:
                problems.append(f"strategy.{key}={getattr(s, key)!r} is not one of {', '.join(OFFLOAD_DEVICES)}")
        if cfg.precision.name == "fp16" and _on_cpu(cfg):
            problems.append(f"precision=fp16 with strategy={s.name} needs a CUDA device (DeepSpeed has no fp16 "
                            f"training on the CPU); use precision=bf16 or fp32 here")
        if cfg.checkpoint.async_save:
            problems.append(f"checkpoint.async_save=true is not available with strategy={s.name} (DeepSpeed writes "
                            f"its checkpoints itself); set checkpoint.async_save=false")
        if world_size > 0:
            try:
                _, ds_problems = build_ds_config(cfg, max(1, world_size))
                problems += ds_problems
            except ConfigError as e:
                problems += e.problems
        return problems

    def model_construction(self, pretrained: bool):
        """ZeRO-3: build under DeepSpeed's partitioned init through transformers' DeepSpeed integration, which
        loads pretrained weights into the partitions: each rank holds its partition plus the module being
        loaded, never the whole model. Presets get their seeded weights one init unit at a time afterwards
        (load_initial_weights), bit-identical to every other strategy's."""
        if self.cfg.strategy.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed  # ZeRO runs only (start-up)
        from transformers.integrations.deepspeed import HfDeepSpeedConfig  # ZeRO runs only (start-up)

        deepspeed.init_distributed()  # adopts the process group, so DeepSpeed's config sees the world size
        self.ds_config, _ = build_ds_config(self.cfg, self.dp_size)
        self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)  # transformers keeps only a weak reference
        return contextlib.nullcontext()

    def setup(self, model, build_optimizer, initial_weights=None):
        import deepspeed  # ZeRO runs only (start-up)

        self.ds_config, _ = build_ds_config(self.cfg, self.dp_size)
        self.prepare_blocks(model)
        self.load_initial_weights(model, initial_weights)
        cast_buffers_in_model_dtype([model], DTYPES[self.cfg.precision.name])  # the engine casts the parameters
        model = model.to(self.device)
        optimizer = build_optimizer(model.named_parameters())
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config)
        unlink_shared_memory_buffer()
        self.model = self.engine
        # Tessera's lr schedule drives the param groups of the client optimizer, which ZeRO steps (its param groups
        # then hold ZeRO's fp32 partitions: the master weights).
        self.optimizer = optimizer
        return self.model, self.optimizer

    def setup_frozen(self, model, initial_weights=None):
        """A frozen model in an engine of its own without an optimizer (as TRL prepares a reference): ZeRO-3
        partitions it like the trained model (parameter offload too), ZeRO-1/2 keep it whole (stage 0) in the
        engine's precision."""
        import deepspeed  # ZeRO runs only (start-up)

        model.requires_grad_(False)
        self.prepare_blocks(model)
        self.load_initial_weights(model, initial_weights)
        cast_buffers_in_model_dtype([model], DTYPES[self.cfg.precision.name])
        config = dict(self.ds_config)
        if self.cfg.strategy.zero_stage != 3:
            config["zero_optimization"] = {"stage": 0}
        self.frozen_engine, _, _, _ = deepspeed.initialize(model=model.to(self.device), config=config)
        self.frozen_engine.eval()  # the engine's eval() returns nothing
        return self.frozen_engine

    frozen_engine = None

    @torch.no_grad()
    def load_initial_weights(self, model, initial_weights) -> None:
        if initial_weights is None or self.cfg.strategy.zero_stage != 3:
            return super().load_initial_weights(model, initial_weights)
        import deepspeed  # ZeRO runs only (start-up)

        targets = named_tensors(model)
        for values in initial_weights:
            # One unit gathered at a time; every rank computes the same values, rank 0's are kept.
            params = [targets[n] for n in values if hasattr(targets[n], "ds_id")]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                for name, value in values.items():
                    targets[name].data.copy_(value)

    def forward_backward(self, micro_batches, num_target_tokens: int, grad_weight: float = 1.0) -> torch.Tensor:
        total = self.begin_step()
        for i, batch in enumerate(micro_batches):
            batch = {k: to_device(v, self.device) for k, v in batch.items()}
            ce_sum, term = micro_batch_losses(self.engine, batch, self.precision, self.tasks, self.router,
                                              objective=self.objective)
            # x dp: DeepSpeed averages over the data-parallel ranks; scale_wrt_gas=False: no 1/accumulation.
            loss = ce_sum * (self.dp_size / num_target_tokens)
            if term is not None:  # the mean of the micro-batches' terms (DeepSpeed averages over the ranks)
                loss = loss + term * (self.router.coef / len(micro_batches))
            self.engine.backward(loss, scale_wrt_gas=False)
            if self._snap_backward_end is not None and i == len(micro_batches) - 1:
                self._snap_backward_end("backward_end")  # memory report only: gradients reduced, not yet stepped
            self.engine.step()  # an optimizer step only at the accumulation boundary (the last micro-batch)
            total += ce_sum.detach()
        return total

    def optimizer_step(self, max_norm: float):
        # The engine stepped (and clipped to gradient_clipping) in forward_backward's last micro-batch.
        norm = self.engine.get_global_grad_norm()
        norm = torch.as_tensor(float(norm) if norm is not None else float("nan"))
        skipped = bool(getattr(self.engine, "skipped_steps", 0) > self._skipped_seen)
        self._skipped_seen = getattr(self.engine, "skipped_steps", 0)
        return norm, skipped

    _skipped_seen = 0
    _snap_backward_end = None  # set while the memory report watches the first step

    def unwrapped(self):
        return self.engine.module

    # ---- checkpoints: DeepSpeed's own sharded format inside the manager's atomic folder ------------------
    def optimizer_param_groups(self) -> list:
        return []  # DeepSpeed's checkpoint carries its optimizer's param groups itself

    def save_checkpoint_state(self, folder: str, group, async_save: bool):
        # universal_checkpoint_info lets ds_to_universal convert this checkpoint for another data-parallel size
        # (plain data parallelism: no tensor-parallel merge patterns).
        self.engine.save_checkpoint(folder, tag="zero", save_latest=False,
                                    client_state={"universal_checkpoint_info": {"universal_checkpoint_version": 0.2}},
                                    exclude_frozen_parameters=self.adapters is not None)  # peft=lora: adapters only
        return None

    def load_checkpoint_from(self, saved: SavedCheckpoint, group) -> None:
        folder, weights_only = saved.folder, saved.weights_only
        load_dir = folder
        if saved.dp_size not in (None, self.dp_size):
            # Another data-parallel size: convert to DeepSpeed's universal checkpoint (every parameter and its
            # optimizer state whole, per parameter) and let each rank take its new partition from it.
            load_dir = self._universal_copy(folder, saved.scratch_dir)
            # DeepSpeed reads this flag from its config only (no setter, and it is known only now): private attribute.
            self.engine._config.load_universal_checkpoint = True
        groups_before = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                         for g in self.optimizer.param_groups]
        try:
            # DeepSpeed unpickles its files with weights_only=False: every rank first checks every file it could
            # read (a refusal stops all ranks alike, before any state changed), and DeepSpeed's reads are made
            # weights-only while it loads (trainer/checkpoint/safe_load.py).
            with checked_deepspeed_folder(load_dir):
                # peft=lora: the module state holds the adapters only (the frozen base is the model's own)
                load_path, _ = self.engine.load_checkpoint(load_dir, tag="zero",
                                                           load_module_strict=self.adapters is None,
                                                           load_optimizer_states=not weights_only,
                                                           load_lr_scheduler_states=False,
                                                           load_module_only=weights_only)
        finally:
            self.engine._config.load_universal_checkpoint = False
        if load_dir != folder:
            # DeepSpeed's ZeRO-3 universal loader copies the first param group's hyper-parameters into every
            # group; Tessera's groups differ (no weight decay on 1-D parameters), so put theirs back.
            for group, before in zip(self.optimizer.param_groups, groups_before):
                group.update(before)
            # It also gives every parameter group one shared `step` tensor, which Adam then advances once per
            # group on each step (wrong bias correction): give each state its own.
            for state in self.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint in {folder}")

    def _universal_copy(self, folder: str, scratch_dir: str) -> str:
        """Convert `folder` once (the first rank to take the lock converts, the others wait on the file lock,
        not in a collective) into <scratch_dir>/.universal-<name>; returns that folder."""
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal  # ZeRO runs only (start-up)

        out = os.path.join(scratch_dir, f".universal-{os.path.basename(folder.rstrip('/'))}")
        done = os.path.join(out, "CONVERTED")
        with file_lock(out + ".lock"):
            if not os.path.exists(done):
                shutil.rmtree(out, ignore_errors=True)
                args = argparse.Namespace(input_folder=os.path.join(folder, "zero"),
                                          output_folder=os.path.join(out, "zero"), num_extract_workers=1,
                                          num_merge_workers=1, keep_temp_folder=False, strict=True,
                                          inject_missing_state=False)
                # The conversion unpickles the checkpoint's files: checked first, then read weights-only.
                with checked_deepspeed_folder(folder), contextlib.redirect_stdout(io.StringIO()):  # its chatter
                    ds_to_universal(args)
                with open(done, "w") as fh:
                    fh.write("ok\n")
        return out

    def full_tensors(self):
        """(name, full fp32 master) per parameter, then the persistent buffers. Collective: every rank iterates.
        ZeRO-1/2: each rank's fragment of the fp32 partition, all-reduced into one full tensor; ZeRO-3: the fp32
        partitions all-gathered (deepspeed.utils.safe_get_full_fp32_param). A parameter the ZeRO optimizer does
        not hold (frozen) has no master: its module copy is taken (gathered under ZeRO-3)."""
        import deepspeed  # ZeRO runs only (start-up)
        from deepspeed.utils import safe_get_full_fp32_param  # ZeRO runs only (start-up)

        model = self.unwrapped()
        # Tied weights are one Parameter: named_parameters lists it once, as HF's save_pretrained does.
        for name, param in model.named_parameters():
            master = safe_get_full_fp32_param(param)  # None on every rank alike (the same parameters everywhere)
            if master is not None:
                yield name, master
                del master
            elif hasattr(param, "ds_id"):
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    yield name, param.data
            else:
                yield name, param.data
        param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        for name, tensor in model.state_dict().items():  # persistent buffers (never partitioned)
            if name not in param_names:
                yield name, tensor

    # ---- the memory report's probe point (logging.memory_report: trainer/observe/) ---------------------------
    def watch_memory(self, snap) -> list:
        """`backward_end`: after the last micro-batch's backward, before the engine steps."""
        self._snap_backward_end = snap

        def disarm():
            self._snap_backward_end = None

        return [disarm]

    def close(self) -> None:
        super().close()
        self.engine = self.frozen_engine = None
        self._hf_ds_config = None

