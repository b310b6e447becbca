"""The DeepSpeed config generated from the Hydra config, and users' own DeepSpeed JSON files."""
from __future__ import annotations

import json

import pytest

from tests.conftest import compose_config
from trainer.run.build import check
from tessera.errors import ConfigError
from trainer.strategies.deepspeed import build_ds_config


def _cfg(*overrides):
    return compose_config(["train.global_batch_size=16", "train.micro_batch_size=2", *overrides])


def test_generated_config_follows_hydra():
    ds, problems = build_ds_config(_cfg("strategy=zero2", "precision=bf16", "train.grad_clip=0.5"), dp_size=2)
    assert problems == []
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (16, 2, 4)
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True} and ds["fp16"]["enabled"] is False
    assert ds["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in ds["zero_optimization"]
    ds3, _ = build_ds_config(_cfg("strategy=zero3_offload"), dp_size=4)
    assert ds3["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds3["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds3["gradient_accumulation_steps"] == 2


def test_users_json_with_auto_values_is_accepted(data_source):
    """Every users' JSON of the source ([generated]: tests/conftest.py; [real]: ../shared/data/deepspeed)."""
    assert data_source.deepspeed
    for name, path in data_source.deepspeed.items():
        strategy = name.split("-")[0]
        ds, problems = build_ds_config(_cfg(f"strategy={strategy}", f"strategy.deepspeed_config={path}"), dp_size=2)
        assert problems == [], (path.name, problems)
        user = json.loads(path.read_text())
        assert ds["train_batch_size"] == 16 and ds["gradient_accumulation_steps"] == 4, path.name
        assert ds["train_micro_batch_size_per_gpu"] == 2, path.name
        assert ds["fp16"]["enabled"] is False, path.name  # "auto" follows precision=fp32
        assert ds["zero_optimization"]["stage"] == int(strategy[-1]), path.name
        zero = ds["zero_optimization"]
        for key, value in user["zero_optimization"].items():
            if value != "auto" and key != "stage":
                assert zero[key] == value, (path.name, key)  # the user's explicit ZeRO knobs are kept
        if user["zero_optimization"].get("reduce_bucket_size") == "auto":
            assert zero["reduce_bucket_size"] == 500_000_000  # filled from strategy.reduce_bucket_size
        assert "optimizer" not in ds and "scheduler" not in ds  # Tessera's optimizer and schedule run everywhere


def test_contradictions_are_reported_with_both_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                                "gradient_accumulation_steps": 8, "gradient_clipping": 2.0,
                                "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                                "optimizer": {"type": "AdamW", "params": {"lr": 0.5}}}))
    _, problems = build_ds_config(_cfg("strategy=zero2", f"strategy.deepspeed_config={path}"), dp_size=2)
    text = "\n".join(problems)
    for both in (("train_batch_size=32", "train.global_batch_size=16"),
                 ("gradient_accumulation_steps=8", "accumulation"),
                 ("gradient_clipping=2.0", "train.grad_clip=1.0"),
                 ("bf16.enabled=True", "precision=fp32"),
                 ("zero_optimization.stage=3", "strategy=zero2"),
                 ("optimizer.params.lr=0.5", "optim.lr=0.001")):
        assert all(k in text for k in both), (both, text)
    assert len(problems) == 6


def test_legacy_cpu_offload_spelling_is_accepted(tmp_path):
    path = tmp_path / "legacy.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "cpu_offload": True}}))
    ds, problems = build_ds_config(_cfg("strategy=zero2", f"strategy.deepspeed_config={path}"), dp_size=1)
    assert problems == [] and ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert "cpu_offload" not in ds["zero_optimization"]


def test_bad_deepspeed_input_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        check(_cfg("strategy=zero2", f"strategy.deepspeed_config={bad}"), world_size=2)
    with pytest.raises(ConfigError, match="cannot read it"):
        check(_cfg("strategy=zero2", f"strategy.deepspeed_config={tmp_path / 'missing.json'}"), world_size=2)
    with pytest.raises(ConfigError) as e:
        check(_cfg("strategy=zero2", "strategy.offload_param=cpu", "checkpoint.async_save=true"), world_size=2)
    text = str(e.value)
    assert "parameter offload (strategy.offload_param=cpu) needs ZeRO stage 3" in text
    assert "checkpoint.async_save=true is not available with strategy=zero2" in text
    with pytest.raises(ConfigError, match="strategy=zero2 does not use strategy.tp"):
        check(_cfg("strategy=zero2", "strategy.tp=2"), world_size=2)
    with pytest.raises(ConfigError, match="NVMe offload needs strategy.nvme_path"):
        check(_cfg("strategy=zero3", "strategy.offload_optimizer=nvme"), world_size=2)
