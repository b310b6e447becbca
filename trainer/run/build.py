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

from models.weights import is_checkpoint
from models import lora, plans, registry
from models.init import initial_weights
from trainer.checkpoint import manager as ckpt
from trainer.checkpoint import resume_plan, resume_policy
from trainer.checkpoint.resume_plan import ResumePlan
from trainer.config import compat
from trainer.config import schema as C
from trainer.observe import comm_bytes
from trainer.parallel import dims as parallel
from trainer.parallel import replica_groups
from trainer.parallel.sync import EveryStep, synchronisation
from trainer.launch import restarts
from trainer.resilience import rundir
from trainer.resilience import watchdog
from trainer.data.datasets import DataSplits, build_data
from trainer.data.sampler import GlobalBatchSampler
from tessera.errors import ConfigError, ModelError
from trainer.observe.metrics import MetricsLogger
from trainer.observe.model_states import built_parameter_bytes
from trainer.observe.trackers import config_problems as tracker_problems, open_trackers
from trainer.run.agreement import check_agreement
from trainer.run.optim import build_optimizer, build_scheduler, optimizer_problems
from trainer.data.preference import holds_pairs, pair_problems
from trainer.objectives.objective import LanguageModeling, build_objective, objective_problems
from trainer.objectives.reference import LiveReference, add_reference_identity, attach_reference, live_reference
from trainer.run.loss import forward_logits
from trainer.run.precision import Precision
from trainer.run.router_loss import RouterBalance, aux_loss_coef, router_loss_problems, routes_tokens
from trainer.run.state import DataPosition, RandomState, TrainState
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
    resume: Optional[ResumePlan] = None  # checkpoint.resume, resolved once (trainer/checkpoint/resume_plan.py)
    model_shapes: Optional[dict] = None
    peft: Optional[dict] = None  # the adapters' summary (peft=lora), which a checkpoint records


def check(cfg: C.TesseraConfig, world_size: int):
    """All configuration problems at once -> (dims, strategy class, tokenizer, model info)."""
    problems = C.validate(cfg, world_size)
    problems += tracker_problems(cfg)  # logging.wandb / logging.mlflow: the package is installed
    cls = strategy_class(cfg.strategy.name)
    dims = None
    if cls is None:
        problems.append(f"strategy.name={cfg.strategy.name!r} is unknown; known: {', '.join(STRATEGIES)}")
    else:
        problems += compat.strategy_problems(cls, cfg, world_size)
    dim_problems = parallel.ParallelDims.problems(cfg.strategy, world_size)
    if dim_problems:
        problems += dim_problems
    else:
        dims = parallel.ParallelDims.from_config(cfg.strategy, world_size)
        problems += C.batch_problems(cfg, dims.dp_size)
        if cls is not None:
            problems += optimizer_problems(cfg, cls.optimizer_parameters(cfg, dims))
    tokenizer = info = None
    if not any(p.startswith("model.") for p in problems):  # the model can only be described when sane
        try:
            tokenizer = registry.load_tokenizer(cfg.model)
            info = registry.describe(cfg.model, tokenizer)
            problems += registry.model_problems(cfg, info, tokenizer)
            # the checks below build the model on the meta device, which an attention kernel this machine lacks
            # (flash_attention_2 on a CPU) or another model problem would end in a library traceback
            buildable = not any(p.startswith("model.") for p in problems)
            if buildable and not any(p.startswith(("peft.r=", "peft.alpha=", "peft.dropout=", "peft.target_modules"))
                                     for p in problems):  # peft can only build adapters from sane values
                problems += lora.model_problems(cfg, info.hf_config)
            if buildable and cls is not None and dims is not None:
                problems += cls.model_problems(cfg, info, dims)
                problems += router_loss_problems(cfg, info.hf_config, dims)
        except ModelError as e:
            problems.append(str(e))
    if dims is not None:
        problems += objective_problems(cfg, dims)
    problems += pair_problems(cfg.data) if holds_pairs(cfg.data) else []
    if problems:
        raise ConfigError(dict.fromkeys(problems))  # de-duplicated, order kept
    return dims, cls, tokenizer, info


def prepare(cfg: C.TesseraConfig, run_dir: str) -> Prepared:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # our own progress output only
    world_size = parallel.env_world_size()
    run_dir = replica_groups.group_run_dir(cfg, run_dir)  # torchft replica groups: a folder per group
    # checkpoint.resume, read once (a restarted launch continues its run): trainer/checkpoint/resume_plan.py
    plan = resume_plan.intend(cfg, run_dir, restarts.restart_count(), log0)
    dims, cls, tokenizer, info = check(cfg, world_size)
    compat.preflight(cfg)  # what the run reaches outside this job (a torchft lighthouse), before any group starts
    from trainer.run.cli import writable_problems  # read-only run / cache folders: one message naming the key

    unwritable = writable_problems(cfg, run_dir)
    if unwritable:
        raise ConfigError(unwritable)
    rundir.claim(run_dir, plan, cfg.checkpoint.overwrite)  # one live job, one run per folder
    prepared = Prepared(cfg, run_dir, world_size, dims, cls, tokenizer, info, resume=plan)
    prepared.data = build_data(cfg, tokenizer, info.vocab_size, log=log0)
    add_reference_identity(cfg, prepared.data)  # DPO / IPO: the reference scores are part of the data's identity
    prepared.data.sampler(cfg.train.global_batch_size, cfg.train.seed)  # size check
    model = lora.meta_adapted(info.hf_config, cfg.peft)
    prepared.model_shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    prepared.peft = lora.Adapters(model).summary() if cfg.peft.name != "none" else None
    prepared.resume = resume_plan.choose(plan, run_dir, lambda path, meta: _resume_problems(prepared, path, meta),
                                         cfg.train.max_steps, log0)
    return prepared


def _resume_problems(p: Prepared, path: str, meta: dict) -> list:
    """What makes checkpoint `path` (its meta.json: `meta`) unusable for this run, each naming its key."""
    cfg, weights_only = p.cfg, p.resume.weights_only
    problems = ckpt.compatibility_problems(meta, cfg, p.model_shapes, p.data.fingerprint, weights_only,
                                           p.strategy_cls.capabilities.checkpoint_format, p.dims.dp_size, peft=p.peft)
    if not weights_only:
        problems += resume_policy.refusals(path, cfg, p.model_info.hf_config)
    return problems


def seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)


@dataclass(frozen=True)
class ModelFacts:
    """What the run knows of its built model, fixed for the run's life (logs, memory.json, checkpoints)."""

    info: registry.ModelInfo
    num_params: int
    shapes: dict
    desc: str
    built_param_bytes: int = 0  # logging.memory_report only: parameter bytes this rank held right after building


@dataclass
class Run:
    """A built run: the config, the train state (`state`: what a checkpoint restores about progress) and the
    services the loop uses. The loop hands each consumer the parts it uses (the divergence guard: the
    checkpointer and the log; the sampler: the stop request, watchdog, log and step; the memory report: the
    strategy and the model's facts), never the whole run."""

    cfg: C.TesseraConfig
    run_dir: str
    state: TrainState
    strategy: object
    data: DataSplits
    sampler: GlobalBatchSampler  # or data.mixture.MixtureSampler: the same interface
    scheduler: object
    tokenizer: object
    model_facts: ModelFacts
    logger: MetricsLogger
    device: torch.device
    resume: ResumePlan
    checkpointer: Optional[ckpt.CheckpointManager] = None
    stop: Optional[StopRequest] = None
    stopped_by: str = ""
    # torchft replica groups around the loop (trainer/parallel/replica_groups.py), or their null object
    ft: object = field(default_factory=replica_groups.NoFaultTolerance)
    # local SGD / DiLoCo around the loop (trainer/parallel/sync.py), or EveryStep
    sync: object = field(default_factory=EveryStep)
    watchdog: object = field(default_factory=watchdog.Unwatched)  # trainer/resilience/watchdog.py: progress, heartbeats
    # export.snapshot_every (trainer/exporting/snapshots.py); off unless build() sets it from the config
    snapshots: Snapshots = field(default_factory=lambda: Snapshots("", 0, 2, writes=False))
    objective: object = field(default_factory=LanguageModeling)  # trainer/objectives/objective.py

    step = property(lambda self: self.state.step)  # optimizer steps done (the loop advances `state`)
    # the model's facts under the names callers used before (read-only)
    model_info = property(lambda self: self.model_facts.info)
    num_params = property(lambda self: self.model_facts.num_params)
    model_shapes = property(lambda self: self.model_facts.shapes)
    built_param_bytes = property(lambda self: self.model_facts.built_param_bytes)


def build(p: Prepared) -> Run:
    """The composition root, in stages: processes, model, logs, services, resume."""
    cfg = p.cfg
    device, rank, watch = _start_processes(p)
    strategy, facts, scheduler = _build_model(p, device, rank)
    logger = _open_logs(p, strategy, facts, device, rank)
    sampler = p.data.sampler(cfg.train.global_batch_size, cfg.train.seed)
    if p.data.tasks:
        strategy.track_tasks(len(p.data.tasks))
        strategy.objective.track_tasks(len(p.data.tasks), device)
    run = Run(cfg, p.run_dir, TrainState(), strategy, p.data, sampler, scheduler, p.tokenizer, facts, logger,
              device, p.resume, watchdog=watch, ft=replica_groups.fault_tolerance(cfg, strategy),
              sync=synchronisation(cfg, strategy), objective=strategy.objective)
    # DPO / IPO: the starting model scores every pair once, before a checkpoint can replace it
    attach_reference(run)
    run.checkpointer = _checkpointer(p, run)
    _resume(run)
    run.stop = StopRequest()
    # data.follow waits for records with the run's stop request
    sampler.bind(run.stop, run.watchdog, logger.info, p.run_dir, run.step)
    run.snapshots = Snapshots(p.run_dir, cfg.export.snapshot_every, cfg.export.snapshot_keep, writes=rank == 0)
    return run


def _start_processes(p: Prepared):
    """The device, the process group (with the run directory every rank agrees on) and the watchdog ->
    (device, rank, watchdog)."""
    cfg = p.cfg
    device = parallel.select_device(cfg.train.device)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Processes of one node share its cores; oversubscribed threads slow every rank down.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
    # logging.comm_bytes: before any process group or engine (they keep references to the collectives)
    comm_bytes.configure(cfg.logging.comm_bytes)
    if p.strategy_cls.capabilities.needs_process_group:
        parallel.init_process_group(device, cfg.train.collective_timeout_s)
        check_agreement(p.run_dir, cfg)  # one run folder (shared across nodes), the same code and config
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    watch = watchdog.start(p.run_dir, rank, world, cfg.train.collective_timeout_s)  # names a stalled rank
    return device, rank, watch


def _build_model(p: Prepared, device, rank: int):
    """The strategy, the model built from the seed (LoRA adapters injected) and parallelized by the strategy, its
    optimizer and schedule -> (strategy, ModelFacts, scheduler)."""
    cfg = p.cfg
    precision = Precision(cfg, device)
    strategy = p.strategy_cls(cfg, p.dims, device, precision)
    model = _construct(p, strategy, device)
    # LoRA goes in before any parallelism: every strategy then wraps the adapted model as it would the model
    adapters = lora.inject(model, cfg.peft, cfg.model.name_or_path) if cfg.peft.name != "none" else None
    strategy.use_adapters(adapters)
    strategy.use_router_balance(_router_balance(cfg, p.model_info.hf_config, model))
    strategy.use_objective(build_objective(cfg))
    num_params = registry.count_parameters(model)
    # memory.json only: ZeRO-3 / FSDP hold their part only
    built_param_bytes = built_parameter_bytes(model) if cfg.logging.memory_report else 0
    seed_everything(cfg.train.seed, rank)
    initial = _initial_weights(p, strategy, model)
    if adapters is not None:  # the base's tensors under the adapted names, then the adapters' initial values
        values = adapters.initial_values(cfg.train.seed, cfg.peft.adapter)
        initial = adapters.pretrained(initial, values) if is_checkpoint(initial) else \
            adapters.initial_units(initial, values)
    embeddings = plans.embedding_weight_names(model)  # Muon leaves them to AdamW
    strategy.setup(model, lambda named: build_optimizer(cfg, named, embeddings), initial)
    if live_reference(cfg) is not None:
        strategy.objective.use_reference(LiveReference(_reference_forward(p, strategy, device)))
    scheduler = build_scheduler(cfg, strategy.optimizer)
    desc = f"{cfg.model.kind}:{cfg.model.name_or_path or 'preset'} {num_params / 1e6:.2f}M params"
    return strategy, ModelFacts(p.model_info, num_params, p.model_shapes, desc, built_param_bytes), scheduler


def _construct(p: Prepared, strategy, device):
    """The model as the strategy has it built (pretrained weights loaded where the strategy does not load them)."""
    cfg = p.cfg
    with strategy.model_construction(pretrained=registry.get_spec(cfg.model.kind).pretrained):
        return registry.build(cfg.model, p.model_info, load_weights=not strategy.caps.loads_pretrained_weights,
                              quantization=cfg.peft.quantization, quantize_on=device)


def _initial_weights(p: Prepared, strategy, model):
    """What the strategy writes into the built model: seeded init units (presets), the pretrained checkpoint (where
    the strategy loads it), or None."""
    cfg = p.cfg
    if not registry.get_spec(cfg.model.kind).pretrained:
        return initial_weights(p.model_info.hf_config, cfg.train.seed)
    return registry.pretrained_weights(cfg.model, model) if strategy.caps.loads_pretrained_weights else None


def _reference_forward(p: Prepared, strategy, device):
    """objective.reference=on_the_fly: the forward of the frozen starting model (a batch -> its logits, eval mode).
    With LoRA (fresh adapters: the base alone computes the starting model) the trained model with its adapters off;
    else a second model built and parallelized like the first, from the same weights, without drawing from the
    run's random streams."""
    router = strategy.router
    if live_reference(p.cfg) == "adapters_off":
        adapters, model = strategy.adapters, strategy.model
        log0("reference model: the trained model's base with its adapters off (objective.reference=on_the_fly)")
        return lambda batch: adapters.base_only(model, lambda: forward_logits(model, batch, strategy.precision, router))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = _construct(p, strategy, device)
        reference = strategy.setup_frozen(model, _initial_weights(p, strategy, model))
    log0("reference model: a frozen copy of the starting model, parallelized like it (objective.reference="
         "on_the_fly)")
    return lambda batch: forward_logits(reference, batch, strategy.precision, router)


def _router_balance(cfg, hf_config, model):
    """A mixture of experts' RouterBalance, hooked on `model`'s routers: where its load-balancing loss is on, or the
    model's config asks for router logits (the model would compute a loss Tessera does not use); else None."""
    coef = aux_loss_coef(cfg.model, hf_config)
    if not routes_tokens(hf_config) or (coef == 0 and not getattr(hf_config, "output_router_logits", False)):
        return None
    router = RouterBalance(coef, hf_config)
    if coef > 0:
        router.attach(model)
    return router


def _open_logs(p: Prepared, strategy, facts: ModelFacts, device, rank: int) -> MetricsLogger:
    """config.yaml (rank 0), the metrics logger, and the run's description in its first lines."""
    cfg = p.cfg
    is0 = rank == 0
    if is0:
        os.makedirs(p.run_dir, exist_ok=True)
        OmegaConf.save(OmegaConf.structured(cfg), os.path.join(p.run_dir, "config.yaml"))
    # logging.wandb / logging.mlflow: rank 0's trackers get the resolved config and every record the logger writes
    trackers = open_trackers(cfg, p.run_dir, is0)
    logger = MetricsLogger(p.run_dir, is0, cfg.train.max_steps, 0, cfg.logging.progress, cfg.logging.tensorboard,
                           trackers=trackers)
    accum = C.grad_accumulation_steps(cfg, p.dims.dp_size)
    logger.info(f"run dir {p.run_dir}")
    logger.info(f"model {cfg.model.kind} {cfg.model.name_or_path or ''} {facts.num_params / 1e6:.2f}M params | "
                f"strategy {cfg.strategy.name} world {p.world_size} (dp {p.dims.dp_size}"
                f"{f', cp {p.dims.cp} {cfg.strategy.cp_impl}' if p.dims.cp_enabled else ''}) | device {device} | "
                f"precision {cfg.precision.name}")
    adapters = strategy.adapters
    if adapters is not None:
        logger.info(adapters.describe() + (f", from {cfg.peft.adapter}" if cfg.peft.adapter else "")
                    + (", base in 4 bits (nf4)" if cfg.peft.quantization == "nf4" else ""))
    logger.info(f"{p.data.description}")
    logger.info(f"global batch {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x accumulation "
                f"{accum} x dp {p.dims.dp_size}; {cfg.train.max_steps} steps")
    return logger


def train_states(run: Run) -> dict:
    """The run's train states (name -> Stateful) that a checkpoint saves and restores, in meta.json's order: the
    counters, the data position, the schedule, the loss scaler, the experiment trackers' runs, this rank's random
    generators."""
    return {"progress": run.state, "loader": DataPosition(run.sampler, run.state), "scheduler": run.scheduler,
            "precision": run.strategy.precision, "trackers": run.logger.trackers, "rng": RandomState()}


def _checkpointer(p: Prepared, run: Run) -> ckpt.CheckpointManager:
    """The checkpoint manager over the run's train states; a replica group that recovers from a live one
    (torchft) copies the schedule and the counters with the weights, once the live group's identity shows that
    it trains the same run (the checks of a resume)."""
    strategy = run.strategy
    identity = ckpt.RunIdentity(p.cfg, p.data.fingerprint, p.model_shapes, run.model_facts.desc, p.tokenizer, p.peft)
    run.ft.share_state("identity", lambda: ckpt.identity_meta(identity, strategy),
                       lambda meta: ckpt.check_peer_identity(meta, identity, strategy))
    run.ft.share_state("progress", run.state.state_dict, run.state.load_state_dict)
    run.ft.share_state("scheduler", run.scheduler.state_dict, run.scheduler.load_state_dict)
    return ckpt.CheckpointManager(p.run_dir, strategy, train_states(run), identity, run.logger,
                                  rank_states=[strategy, run.sync])


def _resume(run: Run) -> None:
    """Carry out the resume plan: load its checkpoint, apply this run's optimizer values and schedule to it, cut the
    logs back to the resumed step, and open the trackers' runs (those of the checkpoint or of the run directory
    this launch continues; a weights-only start is a new run)."""
    plan, logger = run.resume, run.logger
    path = run.checkpointer.resume(plan)
    if path is not None:
        if plan.full:
            for line in resume_policy.apply(path, run.cfg, run.strategy.optimizer, run.scheduler, run.step):
                logger.info(f"resume: {line}")
        logger.start_step = run.step
    if plan.appends_logs:
        logger.resume(run.step)  # drop what a killed attempt logged after the checkpoint
    logger.start_trackers(run.step, continues=plan.appends_logs and not plan.weights_only,
                          checkpoint=path if plan.full else None)


def close(run: Optional[Run], graceful: bool = True) -> None:
    """Release the run; after a failure skip the barrier (a peer may be gone) and only tear down."""
    if run is not None:
        if run.stop is not None:
            run.stop.restore()
        if run.checkpointer is not None and graceful:
            run.checkpointer.close()
        run.logger.close(ok=graceful)
        run.watchdog.close(ended=graceful)  # peers still finishing do not take this rank's silence for a fault
        run.ft.close()
        run.strategy.close()
        run.scheduler = run.checkpointer = None  # the checkpointer holds the scheduler too
    gc.collect()
    if graceful:
        parallel.barrier()
    parallel.destroy_process_group()
    if run is not None:
        rundir.release(run.run_dir)
