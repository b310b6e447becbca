"""Preflight planner: memory and feasibility before launch, from the composed config, without allocating the
model (it is built on the meta device).

    python -m trainer.plan <the same overrides as training> [plan.world_size=N] [plan.device_memory=80]
    ./launch.sh plan <overrides>

Prints, per rank: bytes of parameters, gradients, optimizer state and fp32 master weights for the chosen
strategy (every strategy's own rules: DDP replicas, ZeRO partitions and buckets, FSDP shards and the block being
gathered, tensor-parallel splits, pipeline stages, offload), activations (sequence length, micro-batch,
activation checkpointing, in-flight pipeline micro-batches), host RAM while loading, and every check the
trainer would run before starting (divisibility of degrees, heads, layers, batch). With `plan.device_memory`
(GiB per device) it says whether the run fits and lists the strategies that would, cheapest first.

Each strategy's model-state estimate is a function in trainer/planner/model_states.py; the figures follow what
the memory report (logging.memory_report=true, trainer/observe/memory.py) measures in real runs (per-category peaks
over the first step); tests compare them at world sizes 2 and 4. Activations are an estimate (what autograd keeps per
token and layer for a Llama-style block with fused attention), flagged as such.
"""
from __future__ import annotations

import copy
import fnmatch
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from models import plans, registry
from models.init import decoder_blocks, meta_model
from models.lora import Adapters, meta_adapted
from tessera.errors import EXIT_BAD_INPUT, ConfigError, TesseraError, one_line
from trainer.config import schema as C
from trainer.config.compose import CONF_DIR, compose
from trainer.data.preference import holds_pairs
from trainer.objectives.reference import live_reference
from trainer.parallel.dims import ParallelDims
from trainer.parallel.expert_parallel import expert_modules
from trainer.parallel.pipeline import SCHEDULES, stage_indices, stages_per_rank
from trainer.planner.model_states import MODEL_STATES
from trainer.run import build as B
from trainer.run.cli import debug_traceback, sanitize_argv
from trainer.run.optim import OPTIMIZERS, state_bytes
from trainer.run.precision import element_bytes
from trainer.strategies import STRATEGIES, strategy_class

GIB = 2 ** 30


@dataclass
class Counts:
    """Parameter counts of the model (elements), from a meta-device build."""

    total: int
    blocks: List[int]  # per decoder block
    first: int  # embeddings (first pipeline stage)
    last: int  # final norm + head (last pipeline stage)
    other: int  # anything else (outside blocks, embeddings, head)
    tp_split: Dict[str, int] = field(default_factory=dict)  # params split by tensor parallelism, per block / ends
    largest_block: int = 0
    largest_param: int = 0
    block_experts: int = 0  # mixture-of-experts experts in the largest block (what strategy.ep splits)
    optimizer_state: Dict[str, int] = field(default_factory=dict)  # optim.name -> bytes of state for the whole model


def count_parameters(model, tp: int = 1) -> Counts:
    params = dict(model.named_parameters())
    blocks = decoder_blocks(model)
    block_counts = [sum(p.numel() for p in b.parameters()) for _, b in blocks]
    split = plans.pipeline_split(model)
    first = sum(model.get_submodule(p).weight.numel() for p in (split.first if split else [])
                if hasattr(model.get_submodule(p), "weight"))
    last = 0
    if split:
        for path in split.last:
            last += sum(p.numel() for p in model.get_submodule(path).parameters())
    total = sum(p.numel() for p in params.values())
    plan = plans.tp_plan(model, tp) if tp > 1 else None
    tp_split = {}
    if plan:
        whole = {id(p) for _, m in expert_modules(model) for p in m.parameters()}  # experts stay whole under tp
        for name, p in params.items():
            module = name.rpartition(".")[0]
            if id(p) not in whole and any(fnmatch.fnmatch(module, pattern.replace("*", "[0-9]*")) for pattern in plan):
                tp_split[name] = p.numel()
    other = total - sum(block_counts) - first - last
    experts = [sum(p.numel() for _, m in expert_modules(b) for p in m.parameters()) for _, b in blocks]
    largest = max(range(len(blocks)), key=lambda i: block_counts[i], default=None)
    embeddings = plans.embedding_weight_names(model)
    state = {name: sum(state_bytes(name, tuple(p.shape), n in embeddings) for n, p in params.items())
             for name in OPTIMIZERS}
    return Counts(total, block_counts, first, last, other, tp_split, max(block_counts, default=0),
                  max((p.numel() for p in params.values()), default=0),
                  experts[largest] if largest is not None else 0, state)


@dataclass
class Estimate:
    strategy: str
    world_size: int
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    master_params: float = 0.0
    buffers: float = 0.0  # transient: gathered FSDP blocks, ZeRO buckets beyond gradients
    activations: float = 0.0
    reference: float = 0.0  # objective.reference=on_the_fly: the frozen reference copy (sharded like the model)
    host_params: float = 0.0  # offloaded model states (host RAM, per process)
    host_load: float = 0.0  # host RAM per process while the model is built/loaded
    notes: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer + self.master_params

    @property
    def device_total(self) -> float:
        return self.model_states + self.buffers + self.activations + self.reference


def _stage_share(cfg, dims, counts: Counts, info) -> tuple:
    """(parameters on the heaviest pipeline rank, of which split by tensor parallelism) in elements."""
    s = cfg.strategy
    if dims.pp <= 1:
        split = sum(counts.tp_split.values())
        return counts.total, split
    per_rank = stages_per_rank(s)
    n_stages = dims.pp * per_rank
    ranges = plans.stage_layers(len(counts.blocks), n_stages, s.pp_split_points)
    v_shape = SCHEDULES.get(s.pp_schedule, (None, 1))[1] == "v"
    best = (0, 0)
    for r in range(dims.pp):
        n = 0
        for stage in stage_indices(r, dims.pp, per_rank, v_shape):
            n += sum(counts.blocks[i] for i in ranges[stage])
            n += counts.first if stage == 0 else 0
            n += counts.last if stage == n_stages - 1 else 0
        frac = sum(counts.tp_split.values()) / max(counts.total, 1)
        if n > best[0]:
            best = (n, int(n * frac))
    return best


ALL_IN_FLIGHT = ("gpipe", "looped_bfs")  # pipeline schedules that run every micro-batch's forward before a backward


def activation_bytes(cfg, info, dims, num_layers: int) -> float:
    """Estimate of what autograd keeps at once on the heaviest rank (bytes): the blocks of every micro-batch in
    flight on the rank's pipeline stages, and the head and loss of the last stage's."""
    t = cfg.train
    rows = 2 if holds_pairs(cfg.data) else 1  # a preference pair is two rows (chosen, rejected)
    tokens = rows * t.micro_batch_size * cfg.data.seq_len / max(getattr(dims, "cp", 1), 1)  # a context rank's share
    a = element_bytes(cfg.precision.name)
    block = _block_bytes(cfg, info, dims, tokens, a)
    # the final norm's input and fp32 output, the head's input; the loss's fp32 log-probabilities
    head = tokens * info.hidden_size * (2 * a + 4) + tokens * info.vocab_size * 4
    recomputed = block[0] if t.activation_checkpointing == "full" else 0  # one block again in backward
    if dims.pp <= 1:
        return _kept_bytes(num_layers, block, t) + recomputed + head
    s = cfg.strategy
    per_rank = stages_per_rank(s)
    n_stages = dims.pp * per_rank
    ranges = plans.stage_layers(num_layers, n_stages, s.pp_split_points)
    v_shape = SCHEDULES.get(s.pp_schedule, (None, 1))[1] == "v"
    micro = C.grad_accumulation_steps(cfg, dims.dp_size)
    worst = 0.0
    for r in range(dims.pp):
        stages = stage_indices(r, dims.pp, per_rank, v_shape)
        per_stage = sum(_kept_bytes(len(ranges[i]), block, t) for i in stages) / len(stages)
        held = per_stage * _in_flight(s.pp_schedule, micro, dims.pp, r, len(stages))
        if n_stages - 1 in stages:
            held += head * (micro if s.pp_schedule in ALL_IN_FLIGHT else 1)
        worst = max(worst, held + recomputed)
    return worst


def _block_bytes(cfg, info, dims, tokens: float, a: int) -> tuple:
    """(a decoder block's saved bytes for `tokens` tokens of `a` bytes each, the same block checkpointed: its input
    only)."""
    h = info.hidden_size
    # no attention heads (a state-space model): its projections counted as full-width keys and values
    hkv = h * info.num_kv_heads // info.num_heads if info.num_heads and info.num_kv_heads else h
    inter = getattr(info.hf_config, "intermediate_size", None) or getattr(info.hf_config, "n_inner", None) or 4 * h
    # per token and block: norm inputs/outputs, q, k, v, attention output, o_proj input, MLP gate/up/act/product
    split_values = (h + 2 * hkv + h + 4 * inter) / max(dims.tp, 1)
    whole_values = 4 * h / (dims.tp if cfg.strategy.sequence_parallel else 1)
    full = tokens * (split_values + whole_values) * a + tokens * 2 * h * 4  # + fp32 norm upcasts
    return full, tokens * h * a


def _kept_bytes(layers: int, block: tuple, train_cfg) -> float:
    """What `layers` blocks keep for one micro-batch, every k-th checkpointed with train.activation_checkpointing."""
    if train_cfg.activation_checkpointing != "full":
        return layers * block[0]
    checkpointed = layers // train_cfg.activation_checkpointing_every
    return (layers - checkpointed) * block[0] + checkpointed * block[1]


def _in_flight(schedule: str, micro: int, pp: int, rank: int, local_stages: int) -> float:
    """Micro-batch forwards a pipeline rank holds at once, counted in stages' worth (torch's schedules): GPipe and
    looped BFS all of them; 1F1B pp - rank (the first stage most); the interleaved and V-shaped schedules their
    warm-up, (local stages - 1) x pp + 2 x (pp - 1 - rank), plus one."""
    if schedule in ALL_IN_FLIGHT:
        return micro * local_stages
    if local_stages == 1:
        return min(micro, pp - rank)
    return min(micro * local_stages, (local_stages - 1) * pp + 2 * (pp - 1 - rank) + 1)


def estimate(cfg, world_size: int, info, counts: Optional[Counts] = None) -> Estimate:
    s = cfg.strategy
    est = Estimate(s.name, world_size)
    try:
        B.check(cfg, world_size)
    except ConfigError as e:
        est.problems = list(e.problems)
    except Exception as e:  # noqa: BLE001 - an unknown model etc.: still a problem to report

        debug_traceback()
        est.problems = [one_line(e)]
    if ParallelDims.problems(s, world_size):
        return est
    dims = ParallelDims.from_config(s, world_size)
    model = None
    if counts is None:
        model = meta_adapted(info.hf_config, cfg.peft)  # peft=lora: the adapters counted in
        counts = count_parameters(model, dims.tp)
    here, split = _stage_share(cfg, dims, counts, info)
    rank_params = (here - split) + split / max(dims.tp, 1)  # model-parallel part of this rank
    est.activations = activation_bytes(cfg, info, dims, len(counts.blocks))
    nproc = max(1, world_size)
    cls = strategy_class(s.name)
    if cls is None:  # an unknown strategy: the config problems say so
        return est
    MODEL_STATES[cls](est, cfg, dims, counts, rank_params)  # each strategy's own rules
    if live_reference(cfg) == "copy":  # the same weights held again, as the trained model holds them (no gradients)
        est.reference = est.params
        est.notes.append("objective.reference=on_the_fly: a frozen copy of the model, held as the model is")
    if cfg.peft.name != "none" and model is not None:
        lora_states(est, cfg, info, model)
    est.notes.append(f"host RAM per node while loading: {est.host_load * min(nproc, _local_procs()) / GIB:.2f} GiB "
                     f"({min(nproc, _local_procs())} processes)")
    return est


# bitsandbytes' nf4 with double quantization: 4 bits per weight, an 8-bit scale per block of 64 and an fp32 scale of
# those per 256 blocks
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


def lora_states(est: Estimate, cfg, info, model) -> None:
    """peft=lora: gradients, optimizer state and master weights exist for the adapters only; each strategy shards
    (or not) what trains as it shards the rest, so its estimate scales by the trainable fraction. QLoRA: the linear
    layers of the base (all but the head, as transformers quantizes) in nf4."""
    adapters = Adapters(model)
    fraction = adapters.trained / max(adapters.total, 1)
    est.grads *= fraction
    est.optimizer *= fraction
    est.master_params *= fraction
    est.notes.append(f"peft=lora: {adapters.trained / 1e6:.3f}M of {adapters.total / 1e6:.2f}M parameters train "
                     f"(gradients, optimizer state and master weights for those only)")
    if cfg.peft.quantization == "nf4":
        base = meta_model(info.hf_config)
        head = base.get_output_embeddings()
        quantized = sum(m.weight.numel() for m in base.modules() if isinstance(m, nn.Linear) and m is not head)
        est.params -= (4 - NF4_BYTES) * quantized
        est.notes.append(f"peft.quantization=nf4: {quantized / 1e6:.2f}M base weights at {NF4_BYTES:.3f} bytes each")


def _local_procs() -> int:
    for key in ("LOCAL_WORLD_SIZE", "NPROC_PER_NODE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 8


def feasible(cfg, world_size: int, info, device_gib: float) -> tuple:
    """([(device total GiB, strategy, fits)] for every strategy valid at this world size with its group's
    default degrees, cheapest first; [(strategy, its first problem)] for the others)."""
    rows, invalid = [], []
    conf = str(CONF_DIR / "strategy")
    for name in STRATEGIES:
        path = os.path.join(conf, f"{name}.yaml")
        if not os.path.exists(path):
            continue
        candidate = copy.deepcopy(cfg)
        group = OmegaConf.merge(OmegaConf.structured(C.StrategyConfig), OmegaConf.load(path))
        candidate.strategy = OmegaConf.to_object(group)
        est = estimate(candidate, world_size, info,
                       count_parameters(meta_model(info.hf_config), max(1, candidate.strategy.tp)))
        if est.problems:
            invalid.append((name, est.problems[0]))
            continue
        rows.append((est.device_total / GIB, name, est.device_total / GIB <= device_gib))
    return sorted(rows), invalid


def count_parameters_total(info) -> int:
    return sum(p.numel() for p in meta_model(info.hf_config).parameters())


def _gib(x: float) -> str:
    return f"{x / GIB:8.3f}"


def report(cfg, world_size: int, info, est: Estimate, device_gib: Optional[float]) -> str:
    lines = [f"plan: strategy={est.strategy} world size {world_size} | model {cfg.model.kind} "
             f"{cfg.model.name_or_path or ''}({info.num_layers} layers, hidden {info.hidden_size}, "
             f"{count_parameters_total(info) / 1e6:.1f}M params) | precision {cfg.precision.name} | micro-batch "
             f"{cfg.train.micro_batch_size} x seq {cfg.data.seq_len}"
             + (f" over {cfg.strategy.cp} context ranks ({cfg.strategy.cp_impl})" if cfg.strategy.cp > 1 else "")
             + (f" | experts over {cfg.strategy.ep} ranks" if cfg.strategy.ep > 1 else "")]
    if est.problems:
        lines.append("checks: FAIL")
        lines += [f"  - {p}" for p in est.problems]
    else:
        lines.append("checks: ok (degrees, heads, layers, batch divisibility, strategy options)")
    lines += ["per rank (GiB, heaviest rank):",
              f"  parameters     {_gib(est.params)}", f"  gradients      {_gib(est.grads)}",
              f"  optimizer      {_gib(est.optimizer)}", f"  fp32 master    {_gib(est.master_params)}",
              f"  model states   {_gib(est.model_states)}",
              f"  buffers        {_gib(est.buffers)}  (transient: gathered blocks / reduction buckets)",
              f"  activations    {_gib(est.activations)}  (estimate)",
              *([f"  reference      {_gib(est.reference)}  (objective.reference=on_the_fly)"] if est.reference else []),
              f"  device total   {_gib(est.device_total)}",
              f"  host, offload  {_gib(est.host_params)}",
              f"  host, loading  {_gib(est.host_load)}  (per process)"]
    lines += [f"note: {n}" for n in est.notes]
    if device_gib is not None:
        fits = est.device_total / GIB <= device_gib
        verdict = "fits" if fits else "does NOT fit"
        if est.problems:
            verdict += ", but the config has the problems above"
        lines.append(f"device memory {device_gib:g} GiB: {verdict} ({est.device_total / GIB:.2f} GiB needed)")
        rows, invalid = feasible(cfg, world_size, info, device_gib)
        lines.append(f"strategies at world size {world_size} (their groups' default degrees), cheapest first:")
        for total, name, ok in rows:
            lines.append(f"  {name:14s} {total:8.3f} GiB  {'fits' if ok else 'too big'}")
        for name, problem in invalid:
            lines.append(f"  {name:14s}     n/a    not valid here: {problem}")
    return "\n".join(lines)


EXIT_DOES_NOT_FIT = 1  # `plan` only: the config is valid but needs more than plan.device_memory per device


def main(argv=None) -> int:
    """Exit codes: 0 valid (and fits plan.device_memory when given), 1 valid but does not fit, 2 the config has
    problems (the same problems and code training would give)."""
    argv = sanitize_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg, world_size, device_gib = _compose(argv)

        tokenizer = registry.load_tokenizer(cfg.model)
        info = registry.describe(cfg.model, tokenizer)
        est = estimate(cfg, world_size, info)
        print(report(cfg, world_size, info, est, device_gib))
    except TesseraError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if est.problems:
        return EXIT_BAD_INPUT  # the config has problems: the same code as training would give
    if device_gib is not None and est.device_total / GIB > device_gib:
        return EXIT_DOES_NOT_FIT  # valid, but does not fit plan.device_memory
    return 0


def _compose(overrides):
    """The training config from the same overrides, plus plan.world_size / plan.device_memory."""
    plan = {}
    rest = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key in ("plan.world_size", "plan.device_memory"):
            plan[key] = value
        else:
            rest.append(o)
    try:
        cfg = C.to_object(compose(rest))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError([one_line(e)]) from None
    try:
        ws = plan.get("plan.world_size") or os.environ.get("WORLD_SIZE")
        if not ws:  # one process for a strategy without a process group, else what the launcher would start

            cls = strategy_class(cfg.strategy.name)
            ws = 1 if cls is not None and not cls.capabilities.needs_process_group else \
                int(os.environ.get("NPROC_PER_NODE", 1)) * int(os.environ.get("NNODES", 1))
        ws = int(ws)
        device = float(plan["plan.device_memory"]) if "plan.device_memory" in plan else None
    except ValueError:
        raise ConfigError(["plan.world_size must be an integer and plan.device_memory a number of GiB"]) from None
    return cfg, ws, device


if __name__ == "__main__":
    sys.exit(main())
