"""Typed configuration schema (registered with Hydra's ConfigStore) and cross-field validation.

YAML files under conf/ only select and set values; every key must exist here, so unknown keys fail when
Hydra composes. `validate` then checks the relations between fields and reports every problem at once,
naming the keys to change, before any process group starts.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


@dataclass
class ModelConfig:
    # Registry key: "llama" / "gpt2" build a preset from a config with random init; "hf" loads a pretrained
    # Hugging Face causal LM from `name_or_path` (a local folder or a hub id).
    kind: str = "llama"
    name_or_path: Optional[str] = None
    revision: Optional[str] = None
    trust_remote_code: bool = False
    # Tokenizer: "embedded" is the byte-level tokenizer shipped in the code; otherwise a folder or hub id.
    # For kind=hf, null means the model's own tokenizer.
    tokenizer: Optional[str] = "embedded"
    # Attention kernel (Hugging Face's attn_implementation: eager, sdpa, flex_attention, flash_attention_2, ...).
    # null = chosen from what the model supports (transformers' default: sdpa where the architecture supports
    # it, else eager, e.g. Gemma-2's softcapped attention); an explicit value is used as given, and one the
    # model or machine can't run is a config error.
    attn_implementation: Optional[str] = None
    # Preset sizes (ignored for kind=hf).
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: Optional[int] = None  # null = num_heads (multi-head attention)
    intermediate_size: Optional[int] = None  # null = about 8/3 * hidden, rounded up to 64 (llama), 4*hidden (gpt2)
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    # Init std of the presets' weights.
    initializer_range: float = 0.02


@dataclass
class DataConfig:
    # "embedded" (generated in code, no files), "text" (local text / JSONL / parquet), "hub" (a hub dataset by
    # name) or "sft" (instruction data: alpaca-style or chat `messages`).
    kind: str = "embedded"
    path: Optional[str] = None  # file, folder or glob (text, sft); may be a list separated by commas
    name: Optional[str] = None  # hub dataset id (kind=hub)
    config_name: Optional[str] = None
    split: str = "train"
    revision: Optional[str] = None
    text_field: str = "text"
    seq_len: int = 128
    val_fraction: float = 0.05  # share of sequences held out for validation (by a seeded permutation)
    split_seed: int = 0  # seed of the train/validation split (independent of train.seed)
    cache_dir: Optional[str] = None  # null = $TESSERA_CACHE or ~/.cache/tessera
    # Embedded corpus size (documents); the default model learns it within a minute.
    embedded_documents: int = 4000
    # SFT: chat template override (Jinja); null = tokenizer's own, else Tessera's documented default.
    chat_template: Optional[str] = None
    # Cap on documents/records read (null = all); handy for quick runs on big data.
    max_records: Optional[int] = None


@dataclass
class StrategyConfig:
    name: str = "ddp"
    # Parallel degrees; -1 fills the ranks the others leave. Their product must equal the world size.
    dp_replicate: int = -1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    # Pipeline parallelism: schedule (gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zb, zbv,
    # dualpipev), stages per rank for the looped/interleaved ones (zbv/dualpipev: 2, V-shaped), and the first
    # layer of each stage after the first (null: balanced). Micro-batches per step = gradient accumulation.
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 2
    pp_split_points: Optional[List[int]] = None
    # Tensor parallelism: also split the norms' activations over the sequence (sequence parallelism).
    sequence_parallel: bool = False
    deepspeed_config: Optional[str] = None
    # DeepSpeed ZeRO (strategy=zero1/zero2/zero3/zero3_offload; the group sets zero_stage).
    zero_stage: int = 0
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (stage 3 only)
    nvme_path: Optional[str] = None
    overlap_comm: bool = True
    reduce_bucket_size: float = 5e8
    allgather_bucket_size: float = 5e8
    stage3_prefetch_bucket_size: float = 5e7
    stage3_param_persistence_threshold: float = 1e5
    # FSDP2 (strategy=fsdp / hsdp). true: parameters re-sharded after forward (ZeRO-3-like); false: kept
    # gathered until backward (ZeRO-2-like, one all-gather per step fewer).
    reshard_after_forward: bool = True
    # Mixed precision: dtype of the gathered parameters the blocks compute in, and of the gradient
    # reduction (null: the precision group's dtype for params, fp32 for the reduction).
    param_dtype: Optional[str] = None  # null | fp32 | bf16 | fp16
    reduce_dtype: Optional[str] = None  # null | fp32 | bf16
    cpu_offload: bool = False  # parameters, gradients and optimizer state on the host; the step runs there
    # DDP knobs.
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    # Kernel: auto (fused where every parameter allows it, else torch's default) | fused | foreach | for_loop.
    implementation: str = "auto"


@dataclass
class SchedulerConfig:
    name: str = "cosine"  # constant | linear | cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # final lr / peak lr for linear and cosine


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | bf16 | fp16
    # fp16 dynamic loss scaling.
    init_scale: float = 65536.0
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5


@dataclass
class TrainConfig:
    max_steps: int = 120
    global_batch_size: int = 16  # sequences per optimizer step
    micro_batch_size: int = 8  # sequences per forward/backward on one data-parallel rank
    seed: int = 1234
    log_every: int = 10
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still logged)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    collective_timeout_s: float = 600.0
    # Recompute each checkpointed decoder block's activations in backward: none | full.
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 1  # checkpoint every k-th block (1 = all of them)
    compile: bool = False  # torch.compile each decoder block
    # Divergence guard: a non-finite loss or gradient norm (or, with loss_spike_factor > 0, a logged loss above
    # that factor times the mean of the last 20 logged losses) either stops the run (exit code 3; the last
    # finite checkpoint is kept out of keep_last rotation) or skips the step (no update; counted in
    # skipped_steps). stop | skip
    on_nonfinite: str = "stop"
    loss_spike_factor: float = 0.0  # 0 disables the spike check


@dataclass
class EvalConfig:
    every: int = 40  # 0 disables periodic eval
    max_sequences: int = 256  # validation sequences evaluated each time (0 = all)
    at_end: bool = True
    at_start: bool = False  # evaluate the initial model too (logged as step 0 in eval.jsonl)


@dataclass
class CheckpointConfig:
    every: int = 0  # 0: no periodic checkpoints
    keep_last: int = 2
    resume: str = "none"  # auto | none | <path of a checkpoint, a checkpoints folder or a run directory>
    async_save: bool = False  # write in the background; the step is blocked only while tensors are copied
    at_end: bool = True  # save when training ends (also when stopped by SIGTERM/SIGINT)
    load_weights_only: bool = False  # resume=<path>: take the model weights only and start a new run at step 0
    # A new run (resume=none) in a run directory that holds another run's checkpoints is refused; true moves that
    # run's files aside (to <run dir>/previous-<time>/) first.
    overwrite: bool = False


@dataclass
class LoggingConfig:
    progress: bool = True  # progress bar on rank 0
    tensorboard: bool = False
    # Dense bf16 peak of one device in TFLOP/s for MFU; null = known GPUs are detected, CPU gives no MFU.
    peak_tflops: Optional[float] = None
    # Measure the model-state memory (parameters, gradients, optimizer state, per rank) in the first step and write
    # <run dir>/memory.json: opt-in, since it probes the first step.
    memory_report: bool = False


@dataclass
class ExportConfig:
    hf_at_end: bool = True  # write <run dir>/hf at the end of training
    # dtype of the exported weights (hf/ and `python -m trainer.export`): the fp32 master weights cast to it.
    dtype: str = "fp32"  # fp32 | bf16 | fp16


@dataclass
class TesseraConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


def register_configs() -> None:
    """Make the schema known to Hydra; conf/config.yaml lists `tessera_schema` first in its defaults."""
    ConfigStore.instance().store(name="tessera_schema", node=TesseraConfig)


def to_object(cfg: DictConfig | TesseraConfig) -> TesseraConfig:
    if isinstance(cfg, TesseraConfig):
        return cfg
    plain = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "hydra"}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TesseraConfig), plain))


CHOICES = {
    "model.kind": ("llama", "gpt2", "hf"),
    "data.kind": ("embedded", "text", "hub", "sft"),
    "optim.name": ("adamw", "sgd"),
    "optim.implementation": ("auto", "fused", "foreach", "for_loop"),
    "scheduler.name": ("constant", "linear", "cosine"),
    "precision.name": ("fp32", "bf16", "fp16"),
    "train.activation_checkpointing": ("none", "full"),
    "export.dtype": ("fp32", "bf16", "fp16"),
    "train.on_nonfinite": ("stop", "skip"),
}


# Range of every numeric key (int / float fields of the schema; null is always allowed where the field is
# Optional). Each entry: (test, what the value must be). Floats must also be finite. tests/unit/test_config.py
# walks the dataclasses: a new numeric key without an entry here (or in RANGE_CHECKED_ELSEWHERE) fails it.
def _between(lo, hi, lo_open=False, hi_open=False):
    def test(v):
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    return test, f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def _positive(note: str = ""):
    return (lambda v: v > 0), "> 0" + (f" ({note})" if note else "")


def _at_least(lo, note: str = ""):
    return (lambda v: v >= lo), f">= {lo}" + (f" ({note})" if note else "")


RANGES = {
    "model.hidden_size": _positive(),
    "model.num_layers": _positive(),
    "model.num_heads": _positive(),
    "model.num_kv_heads": _positive("null = model.num_heads"),
    "model.intermediate_size": _positive("null = derived from model.hidden_size"),
    "model.max_position_embeddings": _positive(),
    "model.rope_theta": _positive(),
    "model.initializer_range": _positive("the init std of the preset's weights"),
    "data.seq_len": _positive(),
    "data.val_fraction": _between(0, 1, hi_open=True),
    "data.split_seed": _at_least(0),
    "data.embedded_documents": _positive(),
    "data.max_records": _positive("null = all records"),
    "strategy.pp_stages_per_rank": _positive(),
    "strategy.zero_stage": ((lambda v: v in (0, 1, 2, 3)), "one of 0, 1, 2, 3 (the strategy group sets it)"),
    "strategy.reduce_bucket_size": _positive("elements"),
    "strategy.allgather_bucket_size": _positive("elements"),
    "strategy.stage3_prefetch_bucket_size": _at_least(0, "elements"),
    "strategy.stage3_param_persistence_threshold": _at_least(0, "elements"),
    "strategy.bucket_cap_mb": _positive("MiB"),
    "optim.lr": _positive(),
    "optim.weight_decay": _at_least(0),
    "optim.eps": _positive(),
    "optim.momentum": _between(0, 1, hi_open=True),
    "scheduler.warmup_steps": _at_least(0),
    "scheduler.min_lr_ratio": _between(0, 1),
    "precision.init_scale": _positive(),
    "precision.growth_interval": _positive("steps"),
    "precision.growth_factor": ((lambda v: v > 1), "> 1"),
    "precision.backoff_factor": _between(0, 1, lo_open=True, hi_open=True),
    "train.max_steps": _positive(),
    "train.global_batch_size": _positive(),
    "train.micro_batch_size": _positive(),
    "train.seed": _at_least(0),
    "train.log_every": _positive(),
    "train.grad_clip": _at_least(0, "0 disables clipping"),
    "train.collective_timeout_s": _positive("seconds"),
    "train.activation_checkpointing_every": _positive(),
    "train.loss_spike_factor": ((lambda v: v == 0 or v > 1), "0 (off) or > 1"),
    "eval.every": _at_least(0, "0 disables periodic eval"),
    "eval.max_sequences": _at_least(0, "0 = all"),
    "checkpoint.every": _at_least(0, "0: no periodic checkpoints"),
    "checkpoint.keep_last": _at_least(0, "0 keeps every checkpoint"),
    "logging.peak_tflops": _positive("TFLOP/s; null = detected"),
}

# Numeric keys whose range is checked next to the rules they belong to.
RANGE_CHECKED_ELSEWHERE = {
    "strategy.dp_replicate": "trainer.parallel.ParallelDims.problems (a positive degree or -1)",
    "strategy.dp_shard": "trainer.parallel.ParallelDims.problems (a positive degree or -1)",
    "strategy.tp": "trainer.parallel.ParallelDims.problems (a positive degree or -1)",
    "strategy.pp": "trainer.parallel.ParallelDims.problems (a positive degree or -1)",
    "strategy.pp_split_points": "models.plans.split_problems (increasing layer indices)",
    "optim.betas": "validate (two numbers in [0, 1))",
}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def range_problems(cfg) -> List[str]:
    """One problem per numeric key outside its range (RANGES), each naming the key, its value and the range."""
    problems = []
    for key, (test, what) in RANGES.items():
        node: Any = cfg
        for part in key.split("."):
            node = getattr(node, part)
        if node is None:
            continue
        if not _finite(node):
            problems.append(f"{key}={node} must be a finite number {what}")
        elif not test(node):
            problems.append(f"{key}={node} must be {what}")
    return problems


def validate(cfg: TesseraConfig, world_size: int) -> List[str]:
    """Field-level and cross-field problems of the config alone (strategy- and model-specific checks are added
    by the strategy class and the model registry). Returns every problem found, each naming its keys."""
    problems: List[str] = []

    def get(path: str) -> Any:
        node: Any = cfg
        for part in path.split("."):
            node = getattr(node, part)
        return node

    for key, allowed in CHOICES.items():
        if get(key) not in allowed:
            problems.append(f"{key}={get(key)!r} is not one of {', '.join(allowed)}")

    problems += range_problems(cfg)
    if len(cfg.optim.betas) != 2 or not all(_finite(b) and 0 <= b < 1 for b in cfg.optim.betas):
        problems.append(f"optim.betas={list(cfg.optim.betas)} must be two numbers in [0, 1)")
    if cfg.data.kind in ("text", "sft") and not cfg.data.path:
        problems.append(f"data.path must be set for data.kind={cfg.data.kind} (a file, folder or glob)")
    if cfg.data.kind == "hub" and not cfg.data.name:
        problems.append("data.name must be set for data.kind=hub (a hub dataset id)")
    if cfg.model.kind == "hf" and not cfg.model.name_or_path:
        problems.append("model.name_or_path must be set for model=hf (a local folder or a hub id)")
    if cfg.model.kind != "hf":
        m = cfg.model
        if m.hidden_size > 0 and m.num_heads > 0 and m.hidden_size % m.num_heads:
            problems.append(f"model.hidden_size={m.hidden_size} must be divisible by model.num_heads={m.num_heads}")
        if m.num_kv_heads is not None and m.num_kv_heads > 0 and m.num_heads > 0 and m.num_heads % m.num_kv_heads:
            problems.append(f"model.num_heads={m.num_heads} must be divisible by model.num_kv_heads={m.num_kv_heads}")
    t = cfg.train
    if t.device not in ("auto", "cpu") and not t.device.startswith("cuda"):
        problems.append(f"train.device={t.device!r} must be auto, cpu, cuda or cuda:N")
    if cfg.checkpoint.resume not in ("none", "auto") and not os.path.exists(cfg.checkpoint.resume):
        problems.append(f"checkpoint.resume={cfg.checkpoint.resume!r}: no such path (use auto, none or a path)")
    if cfg.checkpoint.load_weights_only and cfg.checkpoint.resume == "none":
        problems.append("checkpoint.load_weights_only=true needs checkpoint.resume=<path> (or auto)")
    return problems


def batch_problems(cfg: TesseraConfig, dp_size: int) -> List[str]:
    """Global batch = micro batch x accumulation x data-parallel degree, exactly."""
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if gbs <= 0 or mbs <= 0 or dp_size <= 0:
        return []
    if gbs % (mbs * dp_size):
        return [f"train.global_batch_size={gbs} must be divisible by train.micro_batch_size={mbs} x "
                f"data-parallel degree {dp_size} (= {mbs * dp_size}); change train.global_batch_size or "
                f"train.micro_batch_size"]
    return []


def grad_accumulation_steps(cfg: TesseraConfig, dp_size: int) -> int:
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size)
