"""Everything between a composed config and a ready-to-train run.

`prepare` checks the whole config (fields, degrees vs world size, the strategy's own rules, the model's
limits, batch divisibility) and reports every problem at once, then tokenizes the data: all of it before any
process group starts, so bad input never leaves a rank waiting in a collective. `build` then starts the
process group, builds the model from the seed, and lets the strategy parallelize it.
"""
from __future__ import annotations

import gc
import os
import random
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from models import lora, registry
from models.init import initial_weights
from trainer.checkpoint import manager as ckpt
from trainer.config import schema as C
from trainer.observe import comm_bytes
from trainer.parallel import dims as parallel
from trainer.launch import restarts
from trainer.resilience import rundir
from trainer.resilience import watchdog
from trainer.data.datasets import DataSplits, build_data
from trainer.data.sampler import GlobalBatchSampler
from tessera.errors import ConfigError, ModelError, TesseraError
from trainer.observe.metrics import MetricsLogger
from trainer.run.optim import build_optimizer, build_scheduler
from trainer.run.precision import Precision
from trainer.resilience.preemption import StopRequest
from trainer.exporting.snapshots import Snapshots
from trainer.strategies import STRATEGIES, strategy_class


def log0(msg: str) -> None:
    if parallel.is_rank0():
        print(msg, flush=True)


@dataclass
class Prepared:
    cfg: C.TesseraConfig
    run_dir: str
    world_size: int
    dims: parallel.ParallelDims
    strategy_cls: type
    tokenizer: object
    model_info: registry.ModelInfo
    data: Optional[DataSplits] = None
    resume_path: Optional[str] = None
    resume_fallbacks: list = field(default_factory=list)
    model_shapes: Optional[dict] = None
    peft: Optional[dict] = None  # the adapters' summary (peft=lora), which a checkpoint records


def check(cfg: C.TesseraConfig, world_size: int):
    """All configuration problems at once -> (dims, strategy class, tokenizer, model info)."""
    problems = C.validate(cfg, world_size)
    cls = strategy_class(cfg.strategy.name)
    dims = None
    if cls is None:
        problems.append(f"strategy.name={cfg.strategy.name!r} is unknown; known: {', '.join(STRATEGIES)}")
    else:
        problems += cls.config_problems(cfg, world_size)
    dim_problems = parallel.ParallelDims.problems(cfg.strategy, world_size)
    if dim_problems:
        problems += dim_problems
    else:
        dims = parallel.ParallelDims.from_config(cfg.strategy, world_size)
        problems += C.batch_problems(cfg, dims.dp_size)
    tokenizer = info = None
    if not any(p.startswith("model.") for p in problems):  # the model can only be described when sane
        try:
            tokenizer = registry.load_tokenizer(cfg.model)
            info = registry.describe(cfg.model, tokenizer)
            problems += registry.model_problems(cfg, info, tokenizer)
            if not any(p.startswith(("peft.r=", "peft.alpha=", "peft.dropout=", "peft.target_modules"))
                       for p in problems):  # peft can only build adapters from sane values
                problems += lora.model_problems(cfg, info.hf_config)
            if cls is not None and dims is not None:
                problems += cls.model_problems(cfg, info, dims)
        except ModelError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError(dict.fromkeys(problems))  # de-duplicated, order kept
    return dims, cls, tokenizer, info


def prepare(cfg: C.TesseraConfig, run_dir: str) -> Prepared:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # our own progress output only
    world_size = parallel.env_world_size()
    cls = strategy_class(cfg.strategy.name)
    if cls is not None:
        run_dir = cls.run_dir_for(cfg, run_dir)  # torchft replica groups: a folder per group
    restarts.continue_run(cfg, run_dir, log0)  # a restarted launch continues its run (trainer/launch/restarts.py)
    dims, cls, tokenizer, info = check(cfg, world_size)
    cls.preflight(cfg)  # what the strategy reaches outside this job (a torchft lighthouse), before any group starts
    from trainer.run.cli import writable_problems  # read-only run / cache folders: one message naming the key

    unwritable = writable_problems(cfg, run_dir)
    if unwritable:
        raise ConfigError(unwritable)
    rundir.claim(cfg, run_dir)  # one live job, one run per folder (trainer/resilience/rundir.py)
    prepared = Prepared(cfg, run_dir, world_size, dims, cls, tokenizer, info)
    prepared.data = build_data(cfg, tokenizer, info.vocab_size, log=log0)
    prepared.data.sampler(cfg.train.global_batch_size, cfg.train.seed)  # size check
    model = lora.meta_adapted(info.hf_config, cfg.peft)
    prepared.model_shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    prepared.peft = lora.Adapters(model).summary() if cfg.peft.name != "none" else None
    prepared.resume_path = _check_resume(cfg, run_dir, prepared)
    return prepared


def _check_resume(cfg, run_dir: str, p: Prepared) -> Optional[str]:
    """The checkpoint to resume from, checked against this run before any process group starts. With
    resume=auto, older complete checkpoints of the run are kept as fallbacks (`p.resume_fallbacks`) in case the
    chosen one fails its checksums (checked by all ranks together once the process group exists)."""
    from trainer.checkpoint import resume_policy

    root = os.path.join(run_dir, "checkpoints")
    auto = cfg.checkpoint.resume == "auto"
    if auto:
        for partial in ckpt.partial_checkpoints(root):
            log0(f"ignoring incomplete checkpoint {partial} (its save did not finish)")
        candidates = [path for _, path in reversed(ckpt.complete_checkpoints(root))]
    else:
        path = ckpt.resolve(cfg.checkpoint.resume, run_dir)
        candidates = [path] if path else []
    if not candidates:
        if auto:
            log0("checkpoint.resume=auto: no complete checkpoint in the run directory; starting at step 0")
        return None
    usable = []
    for path in candidates:
        try:
            meta = ckpt.read_meta(path)
            ckpt.verify_files(path, meta)
        except ckpt.CheckpointError as e:
            if not auto:
                raise
            log0(f"skipping checkpoint {path}: {e}")
            continue
        problems = ckpt.compatibility_problems(meta, cfg, p.model_shapes, p.data.fingerprint,
                                               cfg.checkpoint.load_weights_only, p.strategy_cls.checkpoint_format,
                                               p.dims.dp_size, peft=p.peft)
        if not cfg.checkpoint.load_weights_only:
            problems += resume_policy.refusals(path, cfg, p.model_info.hf_config)
        if problems:
            raise ckpt.CheckpointError(f"cannot resume from {path}:\n" + "\n".join(f"  - {x}" for x in problems))
        if not usable and meta["step"] >= cfg.train.max_steps and not cfg.checkpoint.load_weights_only:
            raise ckpt.CheckpointError(f"{path} is at step {meta['step']}, which already reaches "
                                       f"train.max_steps={cfg.train.max_steps}; raise train.max_steps to train on")
        usable.append(path)
    if not usable:
        raise ckpt.CheckpointError(f"checkpoint.resume=auto: every checkpoint in {root} is damaged (see above); "
                                   f"start over with checkpoint.resume=none and checkpoint.overwrite=true")
    p.resume_fallbacks = usable[1:]
    return usable[0]


def seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)


@dataclass
class Run:
    """A built run: what the loop needs."""

    cfg: C.TesseraConfig
    run_dir: str
    strategy: object
    data: DataSplits
    sampler: GlobalBatchSampler  # or data.mixture.MixtureSampler: the same interface
    scheduler: object
    tokenizer: object
    model_info: registry.ModelInfo
    logger: MetricsLogger
    device: torch.device
    grad_accum: int
    num_params: int
    model_shapes: dict = field(default_factory=dict)
    model_desc: str = ""
    built_param_bytes: int = 0
    progress: ckpt.TrainingProgress = field(default_factory=ckpt.TrainingProgress)  # what a checkpoint restores
    checkpointer: Optional[ckpt.CheckpointManager] = None
    stop: Optional[StopRequest] = None
    stopped_by: str = ""
    watchdog: object = field(default_factory=watchdog.Unwatched)  # trainer/resilience/watchdog.py: progress, heartbeats
    # export.snapshot_every (trainer/exporting/snapshots.py); off unless build() sets it from the config
    snapshots: Snapshots = field(default_factory=lambda: Snapshots("", 0, 2, writes=False))

    # The loop's counters live in `progress` (the checkpoint manager's collaborator); the run reads as before.
    step = property(lambda self: self.progress.step, lambda self, v: setattr(self.progress, "step", v))
    tokens_seen = property(lambda self: self.progress.tokens_seen,
                           lambda self, v: setattr(self.progress, "tokens_seen", v))
    skipped_steps = property(lambda self: self.progress.skipped_steps,
                             lambda self, v: setattr(self.progress, "skipped_steps", v))


def build(p: Prepared) -> Run:
    cfg = p.cfg
    device = parallel.select_device(cfg.train.device)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Processes of one node share its cores; oversubscribed threads slow every rank down.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
    comm_bytes.install()  # before any process group or engine: they keep references to the collectives
    if p.strategy_cls.needs_process_group:
        parallel.init_process_group(device, cfg.train.collective_timeout_s)
        _check_run_dir_agreement(p.run_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    watch = watchdog.start(p.run_dir, rank, world, cfg.train.collective_timeout_s)  # names a stalled rank
    precision = Precision(cfg, device)
    strategy = p.strategy_cls(cfg, p.dims, device, precision)
    strategy.run_dir = p.run_dir
    pretrained = registry.get_spec(cfg.model.kind).pretrained
    with strategy.model_construction(pretrained=pretrained):
        model = registry.build(cfg.model, p.model_info, load_weights=not strategy.loads_pretrained_weights,
                               quantization=cfg.peft.quantization, quantize_on=device)
    # LoRA goes in before any parallelism: every strategy then wraps the adapted model as it would the model
    adapters = lora.inject(model, cfg.peft, cfg.model.name_or_path) if cfg.peft.name != "none" else None
    strategy.adapters = adapters
    num_params = registry.count_parameters(model)
    # memory.json only: ZeRO-3 / FSDP hold their part only
    built_param_bytes = strategy.built_parameter_bytes(model) if cfg.logging.memory_report else 0
    seed_everything(cfg.train.seed, rank)
    if not pretrained:
        initial = initial_weights(p.model_info.hf_config, cfg.train.seed)
    else:
        initial = registry.pretrained_weights(cfg.model, model) if strategy.loads_pretrained_weights else None
    if adapters is not None:  # the base's tensors under the adapted names, then the adapters' initial values
        values = adapters.initial_values(cfg.train.seed, cfg.peft.adapter)
        initial = adapters.pretrained(initial, values) if hasattr(initial, "read") else \
            adapters.initial_units(initial, values)
    strategy.setup(model, lambda named: build_optimizer(cfg, named), initial)
    scheduler = build_scheduler(cfg, strategy.optimizer)
    is0 = rank == 0
    if is0:
        os.makedirs(p.run_dir, exist_ok=True)
        OmegaConf.save(OmegaConf.structured(cfg), os.path.join(p.run_dir, "config.yaml"))
    logger = MetricsLogger(p.run_dir, is0, cfg.train.max_steps, 0, cfg.logging.progress, cfg.logging.tensorboard)
    accum = C.grad_accumulation_steps(cfg, p.dims.dp_size)
    logger.info(f"run dir {p.run_dir}")
    logger.info(f"model {cfg.model.kind} {cfg.model.name_or_path or ''} {num_params / 1e6:.2f}M params | "
                f"strategy {cfg.strategy.name} world {p.world_size} (dp {p.dims.dp_size}) | device {device} | "
                f"precision {cfg.precision.name}")
    if adapters is not None:
        logger.info(adapters.describe() + (f", from {cfg.peft.adapter}" if cfg.peft.adapter else "")
                    + (", base in 4 bits (nf4)" if cfg.peft.quantization == "nf4" else ""))
    logger.info(f"{p.data.description}")
    logger.info(f"global batch {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x accumulation "
                f"{accum} x dp {p.dims.dp_size}; {cfg.train.max_steps} steps")
    sampler = p.data.sampler(cfg.train.global_batch_size, cfg.train.seed)
    if p.data.tasks:
        strategy.track_tasks(len(p.data.tasks))
    desc = f"{cfg.model.kind}:{cfg.model.name_or_path or 'preset'} {num_params / 1e6:.2f}M params"
    run = Run(cfg, p.run_dir, strategy, p.data, sampler, scheduler, p.tokenizer, p.model_info, logger, device,
              accum, num_params, model_shapes=p.model_shapes, model_desc=desc, built_param_bytes=built_param_bytes,
              watchdog=watch)
    identity = ckpt.RunIdentity(cfg, p.data.fingerprint, p.model_shapes, desc, p.tokenizer, p.peft)
    # A replica group that recovers from a live one (torchft) copies the schedule and the counters with the weights,
    # once the live group's identity shows that it trains the same run (the checks of a resume).
    strategy.share_state("identity", lambda: ckpt.identity_meta(identity, strategy),
                         lambda meta: ckpt.check_peer_identity(meta, identity, strategy))
    strategy.share_state("progress", run.progress.state_dict, run.progress.load_state_dict)
    strategy.share_state("scheduler", scheduler.state_dict, scheduler.load_state_dict)
    run.checkpointer = ckpt.CheckpointManager(p.run_dir, strategy, scheduler, sampler, run.progress, identity, logger)
    if p.resume_path:
        from trainer.checkpoint import resume_policy

        path = run.checkpointer.first_intact([p.resume_path] + p.resume_fallbacks,
                                             fall_back=cfg.checkpoint.resume == "auto")
        run.checkpointer.load(path, weights_only=cfg.checkpoint.load_weights_only)
        if not cfg.checkpoint.load_weights_only:
            for line in resume_policy.apply(run, path):
                logger.info(f"resume: {line}")
        logger.start_step = run.step
    if cfg.checkpoint.resume != "none":
        logger.resume(run.step)  # drop what a killed attempt logged after the checkpoint
    run.stop = StopRequest()
    sampler.bind(run)  # data.follow waits for records with the run's stop request
    run.snapshots = Snapshots(p.run_dir, cfg.export.snapshot_every, cfg.export.snapshot_keep, writes=is0)
    return run


def _check_run_dir_agreement(run_dir: str) -> None:
    if dist.get_world_size() == 1:
        return
    dirs = [None] * dist.get_world_size()
    dist.all_gather_object(dirs, os.path.abspath(run_dir))
    if len(set(dirs)) > 1:
        raise TesseraError(f"ranks disagree on the run directory ({sorted(set(dirs))[:2]} ...); set "
                           f"hydra.run.dir=<one path> on every node")


def close(run: Optional[Run], graceful: bool = True) -> None:
    """Release the run; after a failure skip the barrier (a peer may be gone) and only tear down."""
    if run is not None:
        if run.stop is not None:
            run.stop.restore()
        if run.checkpointer is not None and graceful:
            run.checkpointer.close()
        run.logger.close()
        run.watchdog.close(ended=graceful)  # peers still finishing do not take this rank's silence for a fault
        run.strategy.close()
        run.scheduler = run.checkpointer = None  # the checkpointer holds the scheduler too
    gc.collect()
    if graceful:
        parallel.barrier()
    parallel.destroy_process_group()
    if run is not None:
        rundir.release(run.run_dir)
