"""The planner's model-state predictions (each strategy's `estimate_model_states`) against per-rank memory measured
in real runs (memory.json, logging.memory_report=true) at world size 2, within 10%."""
from __future__ import annotations

import pytest

from models import registry
from models.tokenizer import embedded_tokenizer
from tests.conftest import compose_config
from tests.integration.conftest import memory_reports, rel_err
from trainer.planner.estimate import estimate

MODEL = ["model.hidden_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.intermediate_size=256", "data.embedded_documents=400", "data.seq_len=32"]
ONE_STEP = MODEL + ["logging.progress=false", "train.max_steps=1", "train.global_batch_size=4",
                    "train.micro_batch_size=1", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false",
                    "checkpoint.at_end=false", "logging.tensorboard=false", "precision=bf16",
                    "logging.memory_report=true"]
RUNS = {
    # name: (launcher, world size, overrides)
    "ddp-ws2": ("torchrun", 2, ["strategy=ddp"]),
    "zero2-ws2": ("torchrun", 2, ["strategy=zero2"]),
    "zero3-ws2": ("torchrun", 2, ["strategy=zero3", "strategy.stage3_param_persistence_threshold=0"]),
    "fsdp-ws2": ("torchrun", 2, ["strategy=fsdp"]),
    "tp-ws2": ("torchrun", 2, ["strategy=tp"]),
    "pp-ws2": ("torchrun", 2, ["strategy=pp"]),
    # peft=lora: a frozen base beside adapters that alone have gradients, optimizer state and master weights
    "ddp-lora-ws2": ("torchrun", 2, ["strategy=ddp", "peft=lora", "peft.r=8"]),
    "zero3-lora-ws2": ("torchrun", 2, ["strategy=zero3", "strategy.stage3_param_persistence_threshold=0",
                                        "peft=lora", "peft.r=8"]),
    "fsdp-lora-ws2": ("torchrun", 2, ["strategy=fsdp", "peft=lora", "peft.r=8"]),
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return memory_reports(tmp_path_factory.mktemp("plan"), RUNS, ONE_STEP, workers=2)


@pytest.mark.parametrize("name", list(RUNS))
def test_model_states_match_the_measured_peaks(measured, name):
    _, world, extra = RUNS[name]
    cfg = compose_config(ONE_STEP + extra)
    est = estimate(cfg, world, registry.describe(cfg.model, embedded_tokenizer()))
    assert not est.problems, est.problems
    heaviest = max(measured[name]["ranks"], key=lambda r: r["model_states"])
    predicted = {"params": est.params, "grads": est.grads, "optimizer": est.optimizer,
                 "master_params": est.master_params}
    errors = {k: rel_err(v, heaviest[k]) for k, v in predicted.items() if heaviest[k] or v}
    total_err = rel_err(est.model_states, heaviest["model_states"])
    print(f"plan vs measured {name}: model states {est.model_states / 2**20:.3f} vs "
          f"{heaviest['model_states'] / 2**20:.3f} MiB (rel err {total_err:.3f}); per category "
          + ", ".join(f"{k} {e:.3f}" for k, e in errors.items()))
    assert total_err < 0.10
    assert all(e < 0.10 for e in errors.values()), errors
