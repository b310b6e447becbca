"""What a strategy can run with, declared once per strategy class (`Strategy.capabilities`) and narrowed per
config (`Strategy.capabilities_for(cfg)`): trainer/config/compat.py checks a config against it before any process
group starts, launch.sh's launcher choice, the builder, the checkpoint manager and the exports read it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet


# What a layout hands its optimizer (Strategy.optimizer_parameters): whole tensors, DTensors (FSDP or tensor
# parallelism), or ZeRO's flat 1-D fp32 partitions of all parameters. trainer/run/optim.py checks optim.name against it.
TENSORS, DTENSORS, FLAT_PARTITIONS = "tensors", "dtensors", "flat partitions"


@dataclass(frozen=True)
class Capabilities:
    launcher: str = "torchrun"  # how launch.sh starts it: python (one process), torchrun or deepspeed
    needs_process_group: bool = True
    degrees: FrozenSet[str] = frozenset()  # strategy.<degree> this strategy can use beyond 1
    # True: the model is built without its pretrained weights, which come to load_initial_weights as a
    # models.weights.PretrainedWeights to read part by part; False: registry.build loads them.
    loads_pretrained_weights: bool = False
    compile: bool = True  # train.compile
    fsdp_options: bool = False  # strategy.cpu_offload / param_dtype / reduce_dtype
    zero_options: bool = False  # strategy.zero_quantized_* / zero_hpz_partition_size (ZeRO++)
    checkpoint_format: str = "dcp"  # checkpoints of one format are only read by strategies of the same
    fault_tolerance: FrozenSet[str] = frozenset()  # strategy.fault_tolerance values besides none
    comm_hooks: FrozenSet[str] = frozenset()  # strategy.comm_hook values besides none
    periodic_sync: bool = False  # sync=local_sgd / diloco (trainer/parallel/sync.py)
    skips_nonfinite_steps: bool = True  # train.on_nonfinite=skip
    # peft.quantization=nf4 (QLoRA): bitsandbytes' 4-bit layers cannot be sharded or split, so only strategies that
    # hold the whole model on each rank take them; their exports are written by rank 0 from the model itself.
    holds_whole_model: bool = False
    # Whether trainer/observe/comm_bytes.py sees every collective of a step (metrics.jsonl gets comm_bytes only then).
    counts_all_collectives: bool = True
