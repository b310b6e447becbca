"""Each strategy's per-rank model states (parameters, gradients, optimizer state, fp32 masters, buffers, host
memory while loading) from the config alone: one function per strategy class, mapped in MODEL_STATES. The
figures follow what the memory report (logging.memory_report=true, trainer/observe/) measures in real runs;
tests/integration/test_plan_vs_measured.py compares them at world size 2 (and one process)."""
from __future__ import annotations

from trainer.parallel.sync import sync_state_bytes
from trainer.run.precision import element_bytes
from trainer.strategies.ddp import DDPStrategy
from trainer.strategies.deepspeed import DeepSpeedStrategy
from trainer.strategies.single import SingleStrategy
from trainer.strategies.torch_native import TorchNativeStrategy


def optimizer_bytes_per_param(cfg, counts) -> float:
    """Optimizer-state bytes per parameter: AdamW's two fp32 moments, SGD's momentum; Adafactor's row and column
    means, Muon's momentum (AdamW's moments for the embeddings, head and vectors) and 8-bit AdamW's quantized moments
    as trainer/run/optim.state_bytes counts them over the model's tensors (ZeRO's flat partitions: about the same)."""
    if cfg.optim.name == "adamw":
        return 8  # exp_avg + exp_avg_sq, fp32
    if cfg.optim.name == "sgd":
        return 4 if cfg.optim.momentum else 0
    return counts.optimizer_state[cfg.optim.name] / max(counts.total, 1)


def is_pretrained(cfg) -> bool:
    """Whether the run loads a pretrained model's weights (host RAM while loading holds them once more)."""
    return cfg.model.kind == "hf"


def replica_states(est, cfg, dims, counts, rank_params: float) -> None:
    """A whole fp32 replica per rank with its gradients and optimizer state (single, ddp)."""
    psi = counts.total
    est.params, est.grads, est.optimizer = 4 * psi, 4 * psi, optimizer_bytes_per_param(cfg, counts) * psi
    est.host_load = 4 * psi * (2 if is_pretrained(cfg) else 1)


def ddp_states(est, cfg, dims, counts, rank_params: float) -> None:
    """A replica per rank, plus what sync= keeps beside it: DiLoCo's (or an overlapped round's) fp32 anchor,
    DiLoCo's outer momentum, an overlapped round's sent weights."""
    replica_states(est, cfg, dims, counts, rank_params)
    master, optimizer = sync_state_bytes(cfg, counts.total)
    if master:
        est.master_params += master
        est.optimizer += optimizer
        est.notes.append(f"sync={cfg.sync.name}: the fp32 anchor and outer state beside each worker's replica")


def zero_states(est, cfg, dims, counts, rank_params: float) -> None:
    """bit16 parameters (ZeRO-3: partitioned), fp32 master and optimizer state partitioned; gradients as the memory
    report sees them: the fp32 partition in the step (ZeRO-3: and its bit16 partition). The reduction bucket,
    ZeRO-1/2's bit16 gradient partition and ZeRO-3's gathered parameter go to buffers."""
    s = cfg.strategy
    psi, n, stage, half = counts.total, dims.dp_size, s.zero_stage, element_bytes(cfg.precision.name)
    part = psi / n
    est.params = half * (psi if stage < 3 else part)
    est.master_params = 4 * part
    est.optimizer = optimizer_bytes_per_param(cfg, counts) * part
    est.grads = 4 * part + (half * part if stage == 3 else 0)
    est.buffers = half * min(float(s.reduce_bucket_size), psi)
    # ZeRO-1/2: the bit16 gradient partition; ZeRO-3: a gathered parameter (transient, like FSDP's blocks)
    est.buffers += half * part if stage < 3 else half * counts.largest_param
    if s.offload_optimizer != "none":  # the step runs on the host, on an fp32 copy of the gradients too
        est.host_params += est.master_params + est.optimizer + 4 * part
        est.grads -= 4 * part
        est.master_params = est.optimizer = 0
    if s.offload_param != "none" and stage == 3:
        est.host_params += est.params
        est.params = 0
    whole_model = 4 * psi * (2 if is_pretrained(cfg) else 1)
    est.host_load = 4 * part + 4 * counts.largest_block if stage == 3 else whole_model
    est.notes.append(f"ZeRO-{stage}: bit16 params and gradients, fp32 master and optimizer state partitioned "
                     f"over {n} ranks; gradients peak in the step, when the fp32 gradient partition exists")


def native_states(est, cfg, dims, counts, rank_params: float) -> None:
    """fp32 parameters, gradients and optimizer state of this rank's model-parallel part, sharded over the FSDP
    shard group; one block gathered (and the next prefetched) in the compute dtype, or every block with
    reshard_after_forward=false."""
    s = cfg.strategy
    shard = dims.dp_shard * dims.cp if dims.dp_size > 1 or dims.cp > 1 else 1  # over data x context ranks
    gathered_dtype = element_bytes(s.param_dtype or cfg.precision.name)
    est.params = 4 * rank_params / shard
    est.grads = 4 * rank_params / shard
    est.optimizer = optimizer_bytes_per_param(cfg, counts) * rank_params / shard
    # a block gathers its tensor-parallel part and, of its experts (whole under tp), this rank's 1/ep
    block = (counts.largest_block - counts.block_experts) / max(dims.tp, 1) + counts.block_experts / dims.ep
    if dims.dp_size > 1 or dims.cp > 1:
        est.buffers = gathered_dtype * (rank_params if not s.reshard_after_forward else 2 * block)
    anchor, outer = sync_state_bytes(cfg, rank_params / shard)
    est.master_params += anchor
    est.optimizer += outer
    if anchor:
        est.notes.append(f"sync={cfg.sync.name}: the fp32 anchor and outer state beside each worker's shards")
    if s.cpu_offload:
        est.host_params = est.params + est.grads + est.optimizer
        est.params = est.grads = est.optimizer = 0
    est.host_load = 4 * max(block, counts.first, counts.last) * 2
    est.notes.append(f"parameters on the meta device until sharded; fp32 shards over {shard} rank(s)"
                     + (f", experts over {dims.ep} expert-parallel rank(s)" if dims.ep > 1 else "")
                     + (f", tensor-parallel degree {dims.tp}" if dims.tp > 1 else "")
                     + (f", pipeline degree {dims.pp}" if dims.pp > 1 else ""))


MODEL_STATES = {SingleStrategy: replica_states, DDPStrategy: ddp_states, DeepSpeedStrategy: zero_states,
                TorchNativeStrategy: native_states}
