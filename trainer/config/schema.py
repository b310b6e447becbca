"""Typed configuration schema (registered with Hydra's ConfigStore) and cross-field validation.

YAML files under conf/ only select and set values; every key must exist here, so unknown keys fail when
Hydra composes. `validate` then checks the relations between fields and reports every problem at once,
naming the keys to change, before any process group starts. Every key carries its one-line meaning
(`documented`), from which docs/config.md is generated (`python -m trainer.config_reference --write`).
"""
from __future__ import annotations

import math
import os
from dataclasses import Field, dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


def documented(default: Any, meaning: str) -> Any:
    """A schema field with its one-line meaning. docs/config.md is generated from these
    (`python -m trainer.config_reference --write`), and tests/unit/config/test_docs.py fails on a field without one."""
    if isinstance(default, (list, dict)):  # dataclasses refuse a shared mutable default
        return field(default_factory=lambda: type(default)(default), metadata={"help": meaning})
    return field(default=default, metadata={"help": meaning})


def section(schema: type, meaning: str) -> Any:
    """A top-level group of the config (model, data, ...) with its one-line meaning."""
    return field(default_factory=schema, metadata={"help": meaning})


@dataclass
class ModelConfig:
    kind: str = documented("llama", "Registry key: llama or gpt2 build a preset with random init from train.seed; "
                                    "hf loads a pretrained Hugging Face causal LM from model.name_or_path.")
    name_or_path: Optional[str] = documented(None, "kind=hf: a local model folder or a hub id.")
    revision: Optional[str] = documented(None, "Hub revision (branch, tag or commit) of model.name_or_path.")
    trust_remote_code: bool = documented(False, "Allow code that ships with a hub model to run (off unless set).")
    tokenizer: Optional[str] = documented("embedded", "embedded: the byte-level tokenizer shipped in the code; "
                                                      "else a folder or hub id; null (kind=hf): the model's own.")
    # null leaves the choice to transformers (sdpa where the architecture supports it, else eager, e.g. Gemma-2's
    # softcapped attention); an explicit value the model or machine can't run is a config error.
    attn_implementation: Optional[str] = documented(None, "Attention kernel (eager, sdpa, flex_attention, "
                                                          "flash_attention_2, ...); null = what the model supports.")
    # Preset sizes; kind=hf takes its own from the model's config.
    hidden_size: int = documented(256, "Preset: hidden size (ignored for kind=hf).")
    num_layers: int = documented(4, "Preset: decoder blocks (ignored for kind=hf).")
    num_heads: int = documented(8, "Preset: attention heads (ignored for kind=hf).")
    num_kv_heads: Optional[int] = documented(None, "Preset: key/value heads; null = model.num_heads (multi-head "
                                                   "attention).")
    intermediate_size: Optional[int] = documented(None, "Preset: MLP width; null = about 8/3 x hidden rounded up "
                                                        "to 64 (llama), 4 x hidden (gpt2).")
    max_position_embeddings: int = documented(1024, "Preset: longest sequence the model supports.")
    tie_word_embeddings: bool = documented(False, "Preset: the LM head shares the input embedding's weight.")
    rope_theta: float = documented(10000.0, "Preset (llama): RoPE base frequency.")
    initializer_range: float = documented(0.02, "Preset: init std of the weights.")
    router_aux_loss_coef: Optional[float] = documented(None, "Mixture of experts: weight of the router's "
                                                             "load-balancing loss; null = the model config's own "
                                                             "when output_router_logits, else 0.")


@dataclass
class MixtureSource:
    name: str = documented("", "The task's name in metrics.jsonl and eval.jsonl (letters, digits, _ and -).")
    kind: str = documented("text", "text (documents: text / JSON(L) / parquet), sft (instruction records), tokens "
                                   "(token stores) or preference (pairs; then every source).")
    path: Optional[str] = documented(None, "A file, folder or glob, or several separated by commas.")
    text_field: str = documented("text", "kind=text: the field of JSON/JSONL/parquet records that holds the text.")
    columns: Dict[str, str] = documented({}, "kind=sft or preference: as data.columns, for this source.")
    roles: Dict[str, str] = documented({}, "kind=sft or preference: as data.roles, for this source.")
    weight: Optional[float] = documented(None, "Share of every global batch (relative); null on every source: by "
                                               "size, with data.temperature.")


@dataclass
class DataConfig:
    kind: str = documented("embedded", "embedded (generated in code, no files), text (local text / JSON(L) / "
                                       "parquet), hub, sft (instruction data) or tokens (token stores).")
    path: Optional[str] = documented(None, "kind=text or sft: a file, folder or glob, or several separated by "
                                           "commas (for sft it wins over data.name).")
    name: Optional[str] = documented(None, "kind=hub, or sft without data.path: the hub dataset id.")
    config_name: Optional[str] = documented(None, "Hub dataset (data.name): its configuration (subset) name.")
    split: str = documented("train", "Hub dataset (data.name): the split to read.")
    revision: Optional[str] = documented(None, "Hub dataset (data.name): its revision (branch, tag or commit).")
    text_field: str = documented("text", "Field of JSON/JSONL/parquet/hub records that holds the text.")
    follow: bool = documented(False, "Train on records appended to data.path (a JSONL file, or a folder of *.jsonl "
                                     "files) while the run is live, each once; wait when there is nothing new.")
    follow_replay: float = documented(0.0, "data.follow: share of each global batch drawn from records read "
                                           "earlier (0 = new records only).")
    follow_poll_s: float = documented(2.0, "data.follow: seconds between looks at data.path while it has nothing "
                                           "new.")
    follow_idle_timeout_s: float = documented(0.0, "data.follow: end the run (with a checkpoint and the export) "
                                                   "after this long without a new record; 0 = wait on.")
    streaming: bool = documented(False, "kind=text or hub: read and tokenize the source as training goes (never "
                                        "whole); exact resume by stream position (docs/data.md).")
    seq_len: int = documented(128, "Tokens per training sequence (documents are packed; SFT examples truncated "
                                   "and padded).")
    val_fraction: float = documented(0.05, "Share of the sequences held out for validation (a seeded "
                                           "permutation).")
    split_seed: int = documented(0, "Seed of the train/validation split (independent of train.seed).")
    cache_dir: Optional[str] = documented(None, "Tokenization cache folder; null = $TESSERA_CACHE or "
                                                "~/.cache/tessera.")
    # The default model learns 4000 of them within a minute.
    embedded_documents: int = documented(4000, "kind=embedded: generated documents in the corpus.")
    chat_template: Optional[str] = documented(None, "kind=sft: chat template (Jinja); null = the tokenizer's "
                                                    "own, else Tessera's documented default.")
    columns: Dict[str, str] = documented({}, "kind=sft: Tessera's field name -> your records' ({messages: dialog, "
                                             "role: speaker, instruction: question, ...}); docs/data.md.")
    roles: Dict[str, str] = documented({}, "kind=sft: your records' role names -> Tessera's (system, user, assistant, "
                                           "tool), e.g. {bot: assistant, person: user}.")
    max_records: Optional[int] = documented(None, "Cap on documents/records read (null = all), for quick runs on "
                                                  "big data.")
    document_separator: Optional[str] = documented(None, "Plain-text files: what ends a document (null = one or "
                                                         "more blank lines; any other text is matched exactly).")
    # bounded memory whatever the size of a file or of a document (trainer/data/text_files.py)
    max_document_chars: int = documented(100_000, "Documents are tokenized in pieces of at most this many "
                                                  "characters (cut at whitespace), kept as one document.")
    sources: List[MixtureSource] = documented([], "kind=mixture: the tasks, [{name, kind, path, text_field, "
                                                  "columns, roles, weight}, ...]; each its own data, split and "
                                                  "loss.")
    temperature: float = documented(1.0, "kind=mixture without weights: a source's share is proportional to its "
                                         "sequences^(1/temperature).")
    packing: str = documented("eos", "eos: text joined by EOS and cut, one SFT example per sequence; documents: "
                                     "several per sequence, attention kept inside each.")


@dataclass
class StrategyConfig:
    name: str = documented("ddp", "The strategy; the strategy= group sets it with the degrees that go with it.")
    # Their product must equal the world size.
    dp_replicate: int = documented(-1, "Data-parallel replicas (DDP, ZeRO, the replicate dimension of hsdp); -1 "
                                       "fills the ranks the other degrees leave.")
    dp_shard: int = documented(1, "FSDP shard degree; -1 fills the ranks the other degrees leave.")
    tp: int = documented(1, "Tensor-parallel degree; -1 fills the ranks the other degrees leave.")
    pp: int = documented(1, "Pipeline stages (ranks); -1 fills the ranks the other degrees leave.")
    cp: int = documented(1, "Context-parallel degree: each sequence split over this many ranks (torch-native "
                            "layouts; FSDP shards over data x context ranks).")
    cp_impl: str = documented("ulysses", "Context parallelism: ulysses (all-to-all from sequence to head shards "
                                         "around any attention kernel) or ring (torch's ring attention; CUDA).")
    ep: int = documented(1, "Expert-parallel degree: a mixture-of-experts model's experts split over this many "
                            "of the data (x context) ranks (torch-native layouts).")
    # Micro-batches per step (the pipeline's) = gradient accumulation.
    pp_schedule: str = documented("1f1b", "Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, looped_bfs, "
                                          "interleaved_zb, zbv or dualpipev.")
    pp_stages_per_rank: int = documented(2, "Stages per rank of the looped/interleaved schedules (zbv and "
                                            "dualpipev: 2, V-shaped).")
    pp_split_points: Optional[List[int]] = documented(None, "First layer of each pipeline stage after the first; "
                                                            "null = balanced.")
    sequence_parallel: bool = documented(False, "Tensor parallelism: also split the activations outside "
                                                "attention/MLP over the sequence.")
    deepspeed_config: Optional[str] = documented(None, "ZeRO: your own DeepSpeed JSON; HF-style auto values "
                                                       "are filled from this config, contradictions are errors.")
    zero_stage: int = documented(0, "ZeRO stage; set by strategy=zero1/zero2/zero3/zero3_offload (leave it as "
                                    "the group sets it).")
    offload_optimizer: str = documented("none", "ZeRO: optimizer state in none, cpu or nvme memory.")
    offload_param: str = documented("none", "ZeRO-3: parameters in none, cpu or nvme memory.")
    nvme_path: Optional[str] = documented(None, "ZeRO: folder on a fast local disk for nvme offload.")
    overlap_comm: bool = documented(True, "ZeRO: overlap gradient reduction with backward.")
    reduce_bucket_size: float = documented(5e8, "ZeRO: elements per gradient reduction bucket.")
    allgather_bucket_size: float = documented(5e8, "ZeRO-1/2: elements per parameter all-gather bucket.")
    stage3_prefetch_bucket_size: float = documented(5e7, "ZeRO-3: elements of parameters prefetched ahead of "
                                                         "use.")
    stage3_param_persistence_threshold: float = documented(1e5, "ZeRO-3: parameters with fewer elements stay "
                                                                "whole on every rank.")
    # true is ZeRO-3-like; false is ZeRO-2-like, one all-gather per step fewer.
    reshard_after_forward: bool = documented(True, "FSDP: re-shard parameters after forward (false keeps them "
                                                   "gathered until backward).")
    param_dtype: Optional[str] = documented(None, "FSDP: dtype of the gathered parameters the blocks compute in "
                                                  "(fp32, bf16, fp16); null = the precision group's.")
    reduce_dtype: Optional[str] = documented(None, "FSDP: dtype of the gradient reduction (fp32, bf16); null = "
                                                   "fp32.")
    cpu_offload: bool = documented(False, "FSDP (without tp/pp): parameters, gradients and optimizer state on "
                                          "the host; the optimizer step runs there.")
    bucket_cap_mb: float = documented(25.0, "DDP: gradient bucket size in MiB.")
    find_unused_parameters: bool = documented(False, "DDP: allow parameters that get no gradient in a step.")
    gradient_as_bucket_view: bool = documented(True, "DDP: gradients are views into the buckets (saves a copy).")
    fault_tolerance: str = documented("none", "none, or torchft: ddp or fsdp/hsdp as replica groups coordinated by "
                                              "a torchft lighthouse; the others train on when a group fails "
                                              "(docs/fault-tolerance.md).")
    replica_groups: int = documented(1, "torchft: number of replica groups; each is its own torchrun job and "
                                        "takes its share of the global batch.")
    replica_group: int = documented(-1, "torchft: this job's group, 0..replica_groups-1; -1 = launch.sh starts "
                                        "every group on this machine.")
    lighthouse: str = documented("", "torchft: the lighthouse's address (http://host:port); empty = "
                                     "$TORCHFT_LIGHTHOUSE, or the one launch.sh starts.")
    min_replica_groups: int = documented(1, "torchft: a step needs at least this many groups (the lighthouse's "
                                            "min_replicas).")
    comm_hook: str = documented("none", "DDP: compress the gradient reduction: none, bf16, fp16 or powersgd "
                                        "(torch's DDP communication hooks).")
    powersgd_rank: int = documented(1, "DDP with comm_hook=powersgd: rank of the low-rank factors of each matrix.")
    powersgd_warmup_steps: int = documented(10, "DDP with comm_hook=powersgd: uncompressed steps before PowerSGD "
                                                "starts (at least 2).")
    zero_quantized_weights: bool = documented(False, "ZeRO-3 (ZeRO++ qwZ): all-gather weights in int8; CUDA only.")
    zero_quantized_gradients: bool = documented(False, "ZeRO-3 (ZeRO++ qgZ): reduce gradients in int4; CUDA "
                                                       "only.")
    zero_hpz_partition_size: int = documented(1, "ZeRO-3 (ZeRO++ hpZ): ranks per secondary weight partition (the "
                                                 "GPUs of a node); 1 = off. CUDA only.")


# ZeRO++ keys of strategy (and of a DeepSpeed JSON's zero_optimization) with the value that leaves each off.
ZERO_PLUS_PLUS_OFF = {"zero_quantized_weights": False, "zero_quantized_gradients": False,
                      "zero_hpz_partition_size": 1}


@dataclass
class SyncConfig:
    # docs/communicating-less.md: every_step reduces the gradient each step; local_sgd averages the weights and
    # diloco takes an outer Nesterov step on the averaged change, every sync.every steps.
    name: str = documented("every_step", "How data-parallel workers synchronise: every_step, local_sgd or diloco "
                                         "(every sync.every steps).")
    every: int = documented(1, "local_sgd / diloco: inner steps between synchronisations (H).")
    outer_lr: float = documented(0.7, "diloco: outer learning rate (DiLoCo paper: 0.7).")
    outer_momentum: float = documented(0.9, "diloco: outer Nesterov momentum (DiLoCo paper: 0.9).")
    overlap: bool = documented(False, "local_sgd / diloco: the averaging runs while the next sync.every inner "
                                      "steps compute and is applied one round late (streaming DiLoCo's overlap).")


@dataclass
class OptimConfig:
    name: str = documented("adamw", "Optimizer: adamw, sgd, adafactor, muon (Muon for hidden matrices, AdamW for the "
                                    "rest) or adamw_8bit (bitsandbytes' 8-bit states).")
    lr: float = documented(1e-3, "Peak learning rate.")
    weight_decay: float = documented(0.1, "Weight decay, applied to matrices only.")
    betas: List[float] = documented([0.9, 0.95], "AdamW (also Muon's AdamW part, adamw_8bit): the two moment decay "
                                                 "rates.")
    eps: float = documented(1e-8, "AdamW (also Muon's AdamW part, adamw_8bit): added to the denominator.")
    momentum: float = documented(0.9, "SGD and Muon: momentum.")
    nesterov: bool = documented(False, "SGD and Muon: Nesterov momentum.")
    implementation: str = documented("auto", "Kernel: auto (torch's fused one wherever every parameter allows "
                                             "it), fused, foreach or for_loop.")


@dataclass
class SchedulerConfig:
    name: str = documented("cosine", "Learning-rate schedule after warmup: constant, linear or cosine.")
    warmup_steps: int = documented(0, "Steps of linear warmup to optim.lr.")
    min_lr_ratio: float = documented(0.1, "Final lr / peak lr of the linear and cosine schedules.")


@dataclass
class PrecisionConfig:
    name: str = documented("fp32", "fp32, bf16 or fp16 (autocast with fp32 master weights; fp16 with dynamic loss "
                                   "scaling).")
    init_scale: float = documented(65536.0, "fp16: initial loss scale.")
    growth_interval: int = documented(2000, "fp16: steps without overflow before the loss scale grows.")
    growth_factor: float = documented(2.0, "fp16: factor the loss scale grows by.")
    backoff_factor: float = documented(0.5, "fp16: factor the loss scale shrinks by after an overflow.")


@dataclass
class TrainConfig:
    max_steps: int = documented(120, "Optimizer steps to train.")
    global_batch_size: int = documented(16, "Sequences per optimizer step (over all ranks and micro-batches).")
    micro_batch_size: int = documented(8, "Sequences per forward/backward on one data-parallel rank; gradient "
                                          "accumulation is derived.")
    seed: int = documented(1234, "Seed of the preset weights, the data order and every rank's RNG.")
    log_every: int = documented(10, "Steps between metrics.jsonl records (the last step and eval "
                                     "steps are logged too).")
    grad_clip: float = documented(1.0, "Max global gradient norm; 0 disables clipping (the norm is still "
                                       "logged).")
    device: str = documented("auto", "auto, cpu, cuda or cuda:N.")
    collective_timeout_s: float = documented(600.0, "Seconds a collective may wait, or a rank may go without "
                                                    "progress, before the run stops naming the stalled rank "
                                                    "(exit code 4).")
    max_restarts: int = documented(3, "Automatic restarts of a launch that failed on a fault (launch.sh); each "
                                      "restart resumes from the newest complete checkpoint of the run directory.")
    activation_checkpointing: str = documented("none", "none or full: recompute each checkpointed decoder "
                                                       "block's activations in backward.")
    activation_checkpointing_every: int = documented(1, "Checkpoint every k-th decoder block (1 = all of them).")
    compile: bool = documented(False, "torch.compile each decoder block (not with ZeRO, nor under pp).")
    # The spike check compares a logged loss with the mean of the last 20 logged losses; the last finite
    # checkpoint is kept out of keep_last rotation when the run stops.
    on_nonfinite: str = documented("stop", "A non-finite loss or gradient norm (or a loss spike): stop (exit "
                                           "code 3) or skip the step.")
    max_time_s: float = documented(0.0, "Stop (with a checkpoint, to continue with checkpoint.resume=auto) once the "
                                        "run has trained this many seconds; 0 = no limit.")
    loss_spike_factor: float = documented(0.0, "A logged loss above this factor times the recent mean counts as "
                                               "divergence; 0 disables the check.")


@dataclass
class EvalConfig:
    every: int = documented(40, "Steps between validation evaluations; 0 disables periodic eval.")
    max_sequences: int = documented(256, "Validation sequences evaluated each time (0 = all).")
    at_end: bool = documented(True, "Evaluate after the last step.")
    at_start: bool = documented(False, "Evaluate the initial model too (step 0 in eval.jsonl).")


@dataclass
class CheckpointConfig:
    every: int = documented(0, "Steps between checkpoints; 0: no periodic checkpoints.")
    keep_last: int = documented(2, "Checkpoints kept (older ones are removed); 0 keeps all.")
    resume: str = documented("none", "none, auto (the newest complete checkpoint of the run directory) or a "
                                     "path: a step_<N> folder, a checkpoints folder or a run directory.")
    async_save: bool = documented(False, "Write checkpoints in the background; the step waits only while tensors "
                                         "are copied.")
    at_end: bool = documented(True, "Save when training ends (also when stopped by SIGTERM/SIGINT).")
    load_weights_only: bool = documented(False, "Take only the model weights of checkpoint.resume and start a new "
                                                "run at step 0.")
    # Without it a new run in a folder that holds another run's checkpoints or logs is refused.
    overwrite: bool = documented(False, "A new run moves another run's files in its run directory aside to "
                                        "previous-<time>/ first.")


@dataclass
class LoggingConfig:
    progress: bool = documented(True, "Progress bar on rank 0.")
    tensorboard: bool = documented(False, "Also write TensorBoard events to <run dir>/tensorboard/.")
    peak_tflops: Optional[float] = documented(None, "Dense bf16 peak of one device in TFLOP/s for MFU; null = "
                                                    "known GPUs are detected, CPU gives no MFU.")
    # Opt-in, since it probes the first step.
    memory_report: bool = documented(False, "Measure the first step's model-state memory per rank and write "
                                            "<run dir>/memory.json.")
    # Opt-in, since it replaces torch.distributed's collective functions with counting wrappers.
    comm_bytes: bool = documented(False, "Count the bytes each step's collectives hand over (comm_bytes and "
                                         "comm_bytes_by_kind in metrics.jsonl; trainer/observe/comm_bytes.py).")
    # Experiment trackers (docs/trackers.md, trainer/observe/trackers.py): optional packages, rank 0 only.
    wandb: bool = documented(False, "Also log to Weights & Biases (the wandb package; WANDB_MODE=offline keeps the "
                                    "run in <run dir>/wandb/, or $WANDB_DIR).")
    mlflow: bool = documented(False, "Also log to MLflow (the mlflow package), in logging.mlflow_tracking_uri.")
    mlflow_tracking_uri: Optional[str] = documented(None, "MLflow store or server; null = $MLFLOW_TRACKING_URI, "
                                                          "else sqlite:///<run dir>/mlflow.db.")
    tracker_project: str = documented("tessera", "W&B project and MLflow experiment the run is logged under.")
    tracker_run_name: Optional[str] = documented(None, "Name of the tracker run; null = the run directory's last "
                                                       "two path parts.")


@dataclass
class ExportConfig:
    hf_at_end: bool = documented(True, "Write the final model to <run dir>/hf/ as a Hugging Face folder.")
    dtype: str = documented("fp32", "dtype of exported weights (hf/ and python -m trainer.export): fp32, bf16 or "
                                    "fp16, cast from the fp32 master weights.")
    snapshot_every: int = documented(0, "Every N steps a Hugging Face snapshot in <run dir>/snapshots/step_N and "
                                        "the symlink snapshots/current switched to it; 0 = off.")
    snapshot_keep: int = documented(2, "Snapshots kept (the newest); at least 2, so a reader of current never "
                                       "loses its folder while it loads.")


@dataclass
class PeftConfig:
    # docs/fine-tuning.md: models/lora.py injects peft's LoRA layers before any parallelism applies.
    name: str = documented("none", "none (every parameter trains) or lora (peft's low-rank adapters; the base "
                                   "model stays frozen).")
    r: int = documented(16, "lora: rank of each adapter.")
    alpha: float = documented(32.0, "lora: scaling numerator; an adapter's update is scaled by alpha / r.")
    dropout: float = documented(0.0, "lora: dropout on each adapter's input.")
    target_modules: List[str] = documented(["all-linear"], "lora: module names (or name suffixes) that get "
                                                           "adapters; all-linear = every linear layer but the "
                                                           "output head.")
    modules_to_save: List[str] = documented([], "lora: modules trained fully beside the adapters (e.g. "
                                                "embed_tokens after adding tokens); saved with the adapter.")
    adapter: Optional[str] = documented(None, "lora: a PEFT adapter folder (adapter_config.json + weights) to "
                                              "start from; its r, alpha, targets replace peft.*'s.")
    quantization: str = documented("none", "lora: none, or nf4 (QLoRA: the base held in 4 bits by bitsandbytes; "
                                           "model=hf with strategy=single or ddp).")


@dataclass
class ObjectiveConfig:
    # docs/preference-training.md: the preference losses (trainer/objectives/preference.py) train on data=preference.
    name: str = documented("lm", "lm (next-token cross-entropy), or a preference loss on data=preference: dpo, ipo, "
                                 "simpo, orpo.")
    beta: float = documented(0.1, "dpo/ipo/simpo/orpo: the methods' beta (DPO's KL weight; ORPO's lambda on the "
                                  "odds-ratio term).")
    label_smoothing: float = documented(0.0, "dpo/simpo: assumed share of flipped preference labels (conservative "
                                             "DPO); 0 = none.")
    sft_weight: float = documented(0.0, "dpo/ipo/simpo: weight of the chosen responses' mean token NLL added to the "
                                        "loss (RPO / CPO alpha); 0 = none.")
    simpo_gamma: float = documented(0.5, "simpo: the target reward margin gamma (the loss uses gamma / beta).")
    reference: str = documented("offline", "dpo/ipo: offline (scored once before training, saved beside the token "
                                           "cache) or on_the_fly (a frozen copy scores each batch).")


@dataclass
class TesseraConfig:
    model: ModelConfig = section(ModelConfig, "The model: a preset built from this config, or a pretrained "
                                              "Hugging Face causal LM (model=hf).")
    data: DataConfig = section(DataConfig, "Training and validation data and its tokenization.")
    strategy: StrategyConfig = section(StrategyConfig, "How the model is spread over the ranks: parallel "
                                                       "degrees and each backend's knobs.")
    sync: SyncConfig = section(SyncConfig, "Synchronisation of data-parallel workers: every step, or local SGD / "
                                           "DiLoCo every sync.every steps.")
    optim: OptimConfig = section(OptimConfig, "The optimizer.")
    scheduler: SchedulerConfig = section(SchedulerConfig, "The learning-rate schedule.")
    precision: PrecisionConfig = section(PrecisionConfig, "Compute precision and fp16 loss scaling.")
    train: TrainConfig = section(TrainConfig, "Steps, batch sizes, seed, device and the divergence guard.")
    eval: EvalConfig = section(EvalConfig, "Validation loss and perplexity on the held-out split.")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Saving, keeping and resuming checkpoints.")
    logging: LoggingConfig = section(LoggingConfig, "Console, TensorBoard, MFU and memory reporting; experiment "
                                                    "trackers (W&B, MLflow).")
    export: ExportConfig = section(ExportConfig, "The Hugging Face export of the final model.")
    peft: PeftConfig = section(PeftConfig, "Parameter-efficient fine-tuning: LoRA adapters on a frozen base "
                                           "(QLoRA with a 4-bit base).")
    objective: ObjectiveConfig = section(ObjectiveConfig, "What the model is trained to do: next-token prediction "
                                                          "or a preference loss (DPO, IPO, SimPO, ORPO).")


def schema_fields() -> List[Tuple[str, Field]]:
    """Every key of the schema as ("section.key", its dataclass field), in declaration order."""
    return [(f"{group.name}.{key.name}", key)
            for group in fields(TesseraConfig) for key in fields(group.default_factory)]


# Keys whose value is a mapping of the user's names: they take keys the empty default lacks from the command line
# (data.columns={messages: dialog}), which Hydra's struct mode refuses elsewhere.
OPEN_MAPPINGS = ("data.columns", "data.roles")


def register_configs() -> None:
    """Make the schema known to Hydra; conf/config.yaml lists `tessera_schema` first in its defaults."""
    node = OmegaConf.structured(TesseraConfig)
    for key in OPEN_MAPPINGS:
        OmegaConf.set_struct(OmegaConf.select(node, key), False)
    ConfigStore.instance().store(name="tessera_schema", node=node)


def to_object(cfg: DictConfig | TesseraConfig) -> TesseraConfig:
    if isinstance(cfg, TesseraConfig):
        return cfg
    plain = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "hydra"}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TesseraConfig), plain))


CHOICES = {
    "model.kind": ("llama", "gpt2", "hf"),
    "data.kind": ("embedded", "text", "hub", "sft", "preference", "mixture", "tokens"),
    "data.packing": ("eos", "documents"),
    "optim.name": ("adamw", "sgd", "adafactor", "muon", "adamw_8bit"),
    "optim.implementation": ("auto", "fused", "foreach", "for_loop"),
    "scheduler.name": ("constant", "linear", "cosine"),
    "precision.name": ("fp32", "bf16", "fp16"),
    "train.activation_checkpointing": ("none", "full"),
    "export.dtype": ("fp32", "bf16", "fp16"),
    "train.on_nonfinite": ("stop", "skip"),
    "strategy.fault_tolerance": ("none", "torchft"),
    "strategy.comm_hook": ("none", "bf16", "fp16", "powersgd"),
    "strategy.cp_impl": ("ulysses", "ring"),
    "sync.name": ("every_step", "local_sgd", "diloco"),
    "peft.name": ("none", "lora"),
    "peft.quantization": ("none", "nf4"),
    "objective.name": ("lm", "dpo", "ipo", "simpo", "orpo"),
    "objective.reference": ("offline", "on_the_fly"),
}


# Range of every numeric key (int / float fields of the schema; null is always allowed where the field is
# Optional). Each entry: (test, what the value must be). Floats must also be finite. tests/unit/config/test_config.py
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
    "model.router_aux_loss_coef": _at_least(0, "0 = off; null = the model config's own"),
    "objective.beta": _positive(),
    "objective.label_smoothing": _between(0, 0.5, hi_open=True),
    "objective.sft_weight": _at_least(0, "0 = none"),
    "objective.simpo_gamma": _at_least(0),
    "data.seq_len": _positive(),
    "data.temperature": _positive(),
    "data.follow_replay": _between(0, 1, hi_open=True),
    "data.follow_poll_s": _positive("seconds"),
    "data.follow_idle_timeout_s": _at_least(0, "0 = wait on"),
    "train.max_time_s": _at_least(0, "0 = no limit"),
    "export.snapshot_every": _at_least(0, "0 = off"),
    "export.snapshot_keep": _at_least(2),
    "data.val_fraction": _between(0, 1, hi_open=True),
    "data.split_seed": _at_least(0),
    "data.embedded_documents": _positive(),
    "data.max_records": _positive("null = all records"),
    "data.max_document_chars": _positive(),
    "strategy.pp_stages_per_rank": _positive(),
    "strategy.zero_stage": ((lambda v: v in (0, 1, 2, 3)), "one of 0, 1, 2, 3 (the strategy group sets it)"),
    "strategy.reduce_bucket_size": _positive("elements"),
    "strategy.allgather_bucket_size": _positive("elements"),
    "strategy.stage3_prefetch_bucket_size": _at_least(0, "elements"),
    "strategy.stage3_param_persistence_threshold": _at_least(0, "elements"),
    "strategy.bucket_cap_mb": _positive("MiB"),
    "strategy.replica_groups": _positive(),
    "strategy.replica_group": _at_least(-1, "-1: every group, started by launch.sh"),
    "strategy.min_replica_groups": _positive(),
    "strategy.powersgd_rank": _positive(),
    "strategy.powersgd_warmup_steps": _at_least(2, "torch's PowerSGD starts after DDP's first two steps"),
    "strategy.zero_hpz_partition_size": _positive("1 = off"),
    "sync.every": _positive("steps"),
    "sync.outer_lr": _positive(),
    "sync.outer_momentum": _between(0, 1, hi_open=True),
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
    "train.max_restarts": _at_least(0, "0: no automatic restarts"),
    "train.activation_checkpointing_every": _positive(),
    "train.loss_spike_factor": ((lambda v: v == 0 or v > 1), "0 (off) or > 1"),
    "eval.every": _at_least(0, "0 disables periodic eval"),
    "eval.max_sequences": _at_least(0, "0 = all"),
    "checkpoint.every": _at_least(0, "0: no periodic checkpoints"),
    "checkpoint.keep_last": _at_least(0, "0 keeps every checkpoint"),
    "logging.peak_tflops": _positive("TFLOP/s; null = detected"),
    "peft.r": _positive(),
    "peft.alpha": _positive(),
    "peft.dropout": _between(0, 1, hi_open=True),
}

# Numeric keys whose range is checked next to the rules they belong to.
RANGE_CHECKED_ELSEWHERE = {
    "strategy.dp_replicate": "trainer.parallel.dims.ParallelDims.problems (a positive degree or -1)",
    "strategy.dp_shard": "trainer.parallel.dims.ParallelDims.problems (a positive degree or -1)",
    "strategy.tp": "trainer.parallel.dims.ParallelDims.problems (a positive degree or -1)",
    "strategy.pp": "trainer.parallel.dims.ParallelDims.problems (a positive degree or -1)",
    "strategy.cp": "trainer.parallel.dims.ParallelDims.problems (a positive degree)",
    "strategy.ep": "trainer.parallel.dims.ParallelDims.problems (a positive degree dividing dp_shard x cp)",
    "strategy.pp_split_points": "models.plans.split_problems (increasing layer indices)",
    "optim.betas": "validate (two numbers in [0, 1))",
}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def peft_problems(cfg) -> List[str]:
    """peft.* keys that only peft=lora reads, and QLoRA's own conditions (the model's are in models/lora.py)."""
    p = cfg.peft
    if p.name == "none":
        defaults = PeftConfig()
        set_keys = [f"peft.{k}" for k in ("adapter", "quantization", "modules_to_save")
                    if getattr(p, k) != getattr(defaults, k)]
        return [f"{', '.join(set_keys)} {'is' if len(set_keys) == 1 else 'are'} read with peft=lora only; add "
                f"peft=lora"] if set_keys else []
    problems = []
    if not p.target_modules:
        problems.append("peft.target_modules is empty; name the modules that get adapters (or all-linear)")
    if p.adapter is not None and not os.path.isfile(os.path.join(p.adapter, "adapter_config.json")):
        problems.append(f"peft.adapter={p.adapter!r} is not a PEFT adapter folder (no adapter_config.json in it)")
    if p.quantization == "nf4" and cfg.model.kind != "hf":
        problems.append(f"peft.quantization=nf4 quantizes a pretrained base: use model=hf (model.kind="
                        f"{cfg.model.kind} is a preset with random weights)")
    return problems


def mixture_problems(d) -> List[str]:
    """data.kind=mixture: named sources, each with its data and a weight that is >= 0 (all set or none)."""
    import re

    if d.kind != "mixture":
        return [f"data.sources is read with data.kind=mixture only (data.kind={d.kind}); use data=mixture"] \
            if d.sources else []
    if not d.sources:
        return ["data.kind=mixture needs data.sources=[{name: ..., kind: text|sft|tokens|preference, path: ..., "
                "weight: ...}, ...]"]
    problems, names = [], []
    for i, src in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if not re.fullmatch(r"[A-Za-z0-9_-]+", src.name or ""):
            problems.append(f"{key}.name={src.name!r} must be a name of letters, digits, _ and -")
        elif src.name in names:
            problems.append(f"{key}.name={src.name!r} names two sources; give each its own name")
        names.append(src.name)
        if src.kind not in ("text", "sft", "tokens", "preference"):
            problems.append(f"{key}.kind={src.kind!r} is not one of text, sft, tokens, preference")
        if not src.path:
            problems.append(f"{key}.path must be set (a file, folder or glob)")
        if src.weight is not None and not (_finite(src.weight) and src.weight >= 0):
            problems.append(f"{key}.weight={src.weight} must be >= 0")
    pairs = [s.kind == "preference" for s in d.sources]
    if any(pairs) and not all(pairs):
        problems.append("data.sources: preference sources train a preference objective and the others next-token "
                        "prediction; a mixture's sources are all kind=preference or none")
    weights = [s.weight for s in d.sources]
    if any(w is None for w in weights) and not all(w is None for w in weights):
        problems.append("data.sources: set a weight on every source, or on none (then by size, with "
                        "data.temperature)")
    elif all(w is not None and _finite(w) for w in weights) and not sum(max(w, 0) for w in weights) > 0:
        problems.append(f"data.sources weights {weights} sum to zero; give at least one source a weight > 0")
    return problems


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
    if cfg.data.document_separator == "":
        problems.append("data.document_separator='' is empty: null ends documents at blank lines, or give the text "
                        "that ends one")
    if cfg.data.kind in ("text", "tokens") and not cfg.data.path:
        what = "a file, folder or glob" if cfg.data.kind == "text" else "token store folders: python -m trainer.tokenize"
        problems.append(f"data.path must be set for data.kind={cfg.data.kind} ({what})")
    if cfg.data.kind == "sft" and not cfg.data.path and not cfg.data.name:
        problems.append("data.path (a file, folder or glob) or data.name (a hub dataset) must be set for "
                        "data.kind=sft")
    if cfg.data.kind == "hub" and not cfg.data.name:
        problems.append("data.name must be set for data.kind=hub (a hub dataset id)")
    problems += mixture_problems(cfg.data)
    problems += peft_problems(cfg)
    from trainer.data.follow import follow_problems  # the schema loads without torch (launch.sh reads it)
    from trainer.data.sources import mapping_problems  # (as above: the data modules load when validating)
    from trainer.data.streaming import streaming_problems  # (as above: torch only once validating)

    problems += follow_problems(cfg)
    problems += streaming_problems(cfg)
    problems += mapping_problems(cfg.data)
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
