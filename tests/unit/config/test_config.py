"""The Hydra config tree, the typed schema, whole-config checks (every problem at once) and ParallelDims."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from trainer.config import schema as C
from trainer.run.build import check
from tessera.errors import ConfigError
from trainer.parallel.dims import ParallelDims

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"

GROUPS = {
    "model": ["tiny", "llama_10m", "llama_100m", "gpt2_10m", "gpt2_100m", "hf"],
    "data": ["default", "text", "hub", "sft", "preference", "mixture", "tokens"],
    "strategy": ["single", "ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp", "hsdp", "tp", "pp",
                 "fsdp_tp", "pp_fsdp", "3d"],
    "optim": ["adafactor", "adamw", "adamw_8bit", "muon", "sgd"],
    "scheduler": ["constant", "linear", "cosine"],
    "precision": ["fp32", "bf16", "fp16"],
    "experiment": ["stories_shakespeare", "alpaca_sft"],
    "objective": ["lm", "dpo", "ipo", "simpo", "orpo"],
}


def test_group_options_match_conf_folder():
    """Every option on disk is covered below, and nothing listed here is missing from conf/."""
    for group, options in GROUPS.items():
        on_disk = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        assert on_disk == sorted(options), group


def test_default_composes_to_typed_config(compose):
    cfg = compose()
    assert isinstance(cfg, C.TesseraConfig)
    # model: tiny preset
    m = cfg.model
    assert (m.kind, m.tokenizer, m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size,
            m.max_position_embeddings) == ("llama", "embedded", 256, 4, 8, 4, 704, 1024)
    assert m.name_or_path is None
    # data: embedded
    assert (cfg.data.kind, cfg.data.seq_len, cfg.data.path) == ("embedded", 128, None)
    # strategy: ddp filling the world with replicas
    s = cfg.strategy
    assert (s.name, s.dp_replicate, s.dp_shard, s.tp, s.pp) == ("ddp", -1, 1, 1, 1)
    assert (cfg.optim.name, cfg.optim.lr, list(cfg.optim.betas)) == ("adamw", 1e-3, [0.9, 0.95])
    assert (cfg.scheduler.name, cfg.scheduler.warmup_steps, cfg.scheduler.min_lr_ratio) == ("cosine", 10, 0.1)
    assert cfg.precision.name == "fp32"
    assert (cfg.train.max_steps, cfg.train.global_batch_size, cfg.train.micro_batch_size) == (120, 16, 8)
    # the default is valid as it stands, for one process and for two
    assert C.validate(cfg, 1) == []
    assert C.validate(cfg, 2) == []


def test_raw_compose_has_exactly_the_schema_sections(compose):
    raw = compose(typed=False)
    assert set(raw.keys()) == {f.name for f in fields(C.TesseraConfig)}  # no `hydra` node, nothing extra
    assert {"model", "data", "strategy", "optim", "scheduler", "precision", "train"} <= set(raw.keys())
    assert OmegaConf.is_struct(raw)  # new keys cannot be added by accident


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes(compose, group, option):
    cfg = compose([f"{group}={option}"])
    assert isinstance(cfg, C.TesseraConfig)
    expected = {
        ("model", "tiny"): lambda c: c.model.kind == "llama" and c.model.hidden_size == 256,
        ("model", "llama_10m"): lambda c: c.model.kind == "llama" and c.model.hidden_size == 384,
        ("model", "llama_100m"): lambda c: c.model.kind == "llama" and c.model.hidden_size == 768,
        ("model", "gpt2_10m"): lambda c: c.model.kind == "gpt2" and c.model.hidden_size == 384,
        ("model", "gpt2_100m"): lambda c: c.model.kind == "gpt2" and c.model.hidden_size == 768,
        ("model", "hf"): lambda c: c.model.kind == "hf" and c.model.tokenizer is None,
        ("data", "default"): lambda c: c.data.kind == "embedded",
        ("data", "text"): lambda c: c.data.kind == "text" and c.data.seq_len == 512,
        ("data", "hub"): lambda c: c.data.kind == "hub",
        ("data", "mixture"): lambda c: c.data.kind == "mixture" and c.data.sources == [],
        ("data", "sft"): lambda c: c.data.kind == "sft",
        ("data", "preference"): lambda c: c.data.kind == "preference" and c.data.seq_len == 512,
        ("objective", "lm"): lambda c: c.objective.name == "lm",
        ("objective", "dpo"): lambda c: c.objective.name == "dpo" and c.objective.beta == 0.1,
        ("objective", "ipo"): lambda c: c.objective.name == "ipo" and c.objective.beta == 0.1,
        ("objective", "simpo"): lambda c: c.objective.name == "simpo" and c.objective.beta == 2.0,
        ("objective", "orpo"): lambda c: c.objective.name == "orpo" and c.objective.beta == 0.1,
        ("data", "tokens"): lambda c: c.data.kind == "tokens" and c.data.path is None,
        ("strategy", "single"): lambda c: c.strategy.name == "single",
        ("strategy", "ddp"): lambda c: c.strategy.name == "ddp",
        ("strategy", "zero1"): lambda c: c.strategy.name == "zero1" and c.strategy.zero_stage == 1,
        ("strategy", "zero2"): lambda c: c.strategy.name == "zero2" and c.strategy.zero_stage == 2,
        ("strategy", "zero3"): lambda c: c.strategy.name == "zero3" and c.strategy.zero_stage == 3,
        ("strategy", "zero3_offload"): lambda c: (c.strategy.zero_stage == 3 and c.strategy.offload_optimizer == "cpu"
                                                  and c.strategy.offload_param == "cpu"),
        ("strategy", "fsdp"): lambda c: (c.strategy.name == "fsdp" and c.strategy.dp_replicate == 1
                                         and c.strategy.dp_shard == -1 and c.strategy.reshard_after_forward),
        ("strategy", "hsdp"): lambda c: (c.strategy.name == "hsdp" and c.strategy.dp_replicate == -1
                                         and c.strategy.dp_shard == 2),
        ("strategy", "tp"): lambda c: c.strategy.name == "tp" and c.strategy.tp == -1,
        ("strategy", "pp"): lambda c: c.strategy.name == "pp" and c.strategy.pp == -1,
        ("strategy", "fsdp_tp"): lambda c: c.strategy.name == "fsdp_tp" and (c.strategy.tp, c.strategy.dp_shard) == (2, -1),
        ("strategy", "pp_fsdp"): lambda c: c.strategy.name == "pp_fsdp" and (c.strategy.pp, c.strategy.dp_shard) == (2, -1),
        ("strategy", "3d"): lambda c: c.strategy.name == "3d" and (c.strategy.pp, c.strategy.tp, c.strategy.dp_shard) == (2, 2, -1),
        ("optim", "adamw"): lambda c: c.optim.name == "adamw",
        ("optim", "sgd"): lambda c: c.optim.name == "sgd" and c.optim.lr == 0.01 and c.optim.weight_decay == 0.0,
        ("optim", "adafactor"): lambda c: c.optim.name == "adafactor" and c.optim.lr == 0.01 and c.optim.weight_decay == 0,
        ("optim", "muon"): lambda c: (c.optim.name == "muon" and c.optim.lr == 1e-3 and c.optim.momentum == 0.95
                                      and c.optim.nesterov),
        ("optim", "adamw_8bit"): lambda c: c.optim.name == "adamw_8bit" and list(c.optim.betas) == [0.9, 0.95],
        ("scheduler", "constant"): lambda c: c.scheduler.name == "constant",
        ("scheduler", "linear"): lambda c: c.scheduler.name == "linear",
        ("scheduler", "cosine"): lambda c: c.scheduler.name == "cosine",
        ("precision", "fp32"): lambda c: c.precision.name == "fp32",
        ("precision", "bf16"): lambda c: c.precision.name == "bf16",
        ("precision", "fp16"): lambda c: c.precision.name == "fp16",
        ("experiment", "stories_shakespeare"): lambda c: (
            c.model.kind == "hf" and c.model.name_or_path == "Xenova/llama2.c-stories15M" and c.data.kind == "hub"
            and c.data.name == "karpathy/tiny_shakespeare" and c.data.path is None and c.data.seq_len == 256
            and c.optim.lr == 5e-4),
        ("experiment", "alpaca_sft"): lambda c: (
            c.model.kind == "hf" and c.model.name_or_path == "Xenova/llama2.c-stories15M" and c.data.kind == "sft"
            and c.data.name == "tatsu-lab/alpaca" and c.data.path is None and c.train.micro_batch_size == 4),
    }[(group, option)]
    assert expected(cfg), cfg


def test_group_override_replaces_preset_fields(compose):
    """model=hf replaces the tiny preset: no preset field leaks from the default group."""
    cfg = compose(["model=hf"])
    assert cfg.model.num_kv_heads is None and cfg.model.intermediate_size is None


def test_unknown_key_fails_at_compose(compose):
    with pytest.raises(ConfigCompositionException, match="train.bogus"):
        compose(["train.bogus=1"])
    with pytest.raises(ConfigCompositionException, match="model.hiden_size"):
        compose(["model.hiden_size=64"])


def test_wrong_type_fails_at_compose(compose):
    with pytest.raises(ConfigCompositionException, match="train.max_steps"):
        compose(["train.max_steps=abc"])
    with pytest.raises(ConfigCompositionException, match="optim.lr"):
        compose(["optim.lr=fast"])


def test_unknown_group_option_fails(compose):
    with pytest.raises(ConfigCompositionException):
        compose(["model=llama_7b"])


def test_to_object_rejects_keys_outside_the_schema():
    bad = OmegaConf.create({"train": {"max_steps": 5, "bogus": 1}})
    with pytest.raises(Exception, match="bogus"):
        C.to_object(bad)


def test_overrides_reach_the_typed_config(compose):
    cfg = compose(["train.max_steps=7", "data.seq_len=64", "optim.betas=[0.8,0.9]", "strategy=single"])
    assert (cfg.train.max_steps, cfg.data.seq_len, list(cfg.optim.betas), cfg.strategy.name) == \
        (7, 64, [0.8, 0.9], "single")


# ---------------------------------------------------------------------------------------------------------
# trainer.run.build.check: every problem at once, each naming its keys.

def _check_problems(cfg, world_size):
    with pytest.raises(ConfigError) as info:
        check(cfg, world_size)
    err = info.value
    assert len(err.problems) == len(set(err.problems))  # de-duplicated
    assert str(len(err.problems)) in str(err)
    return err.problems


def _only_one(problems, *needles):
    hits = [p for p in problems if all(n in p for n in needles)]
    assert len(hits) == 1, (needles, problems)
    return hits[0]


def test_check_reports_every_problem_at_once(compose):
    cfg = compose(["strategy=single", "train.global_batch_size=10", "train.micro_batch_size=4",
                   "data.seq_len=2048"])
    problems = _check_problems(cfg, 2)
    assert len(problems) == 3, problems
    batch = _only_one(problems, "train.global_batch_size=10", "train.micro_batch_size=4")
    assert "data-parallel degree 2" in batch and "(= 8)" in batch
    _only_one(problems, "data.seq_len=2048", "model.max_position_embeddings=1024")
    _only_one(problems, "strategy=single", "world size is 2")
    # each of them is in the message the user sees
    with pytest.raises(ConfigError) as info:
        check(cfg, 2)
    for p in problems:
        assert p in str(info.value)


def test_check_reports_field_strategy_and_model_problems_together(compose):
    cfg = compose(["optim.lr=-1", "train.max_steps=0", "strategy.tp=2", "scheduler.min_lr_ratio=2",
                   "model=gpt2_10m", "model.num_kv_heads=2", "optim.betas=[0.9,1.5]", "data.val_fraction=1.0"])
    problems = _check_problems(cfg, 2)
    _only_one(problems, "optim.lr=-1")
    _only_one(problems, "train.max_steps=0")
    _only_one(problems, "strategy.tp", "strategy=ddp")
    _only_one(problems, "scheduler.min_lr_ratio")
    _only_one(problems, "model.num_kv_heads")
    _only_one(problems, "optim.betas")
    _only_one(problems, "data.val_fraction")
    assert len(problems) == 7, problems


def test_check_parallel_degree_problems(compose):
    cfg = compose(["strategy.dp_replicate=3"])  # 3 replicas on a world of 2
    problems = _check_problems(cfg, 2)
    _only_one(problems, "strategy.dp_replicate=3", "world size is 2")


def test_check_pipeline_stages_over_context_ranks(compose):
    """pp x cp composes (FSDP sums the context ranks' gradients), so the split-backward schedules are refused as
    with data parallelism; 1F1B is not."""
    base = ["strategy=pp", "strategy.pp=2", "strategy.cp=2", "train.global_batch_size=8", "train.micro_batch_size=2"]
    dims = check(compose(base + ["strategy.pp_schedule=1f1b"]), 4)[0]
    assert (dims.pp, dims.cp, dims.dp_size) == (2, 2, 1)
    problems = _check_problems(compose(base + ["strategy.pp_schedule=zbv"]), 4)
    _only_one(problems, "strategy.pp_schedule=zbv splits the backward", "data-parallel degree 1, strategy.cp=2")
    assert len(problems) == 1, problems


def test_check_missing_paths_for_file_data(compose):
    problems = _check_problems(compose(["data=text"]), 1)
    _only_one(problems, "data.path must be set", "data.kind=text")
    problems = _check_problems(compose(["data=hub"]), 1)
    _only_one(problems, "data.name must be set")
    problems = _check_problems(compose(["data=sft"]), 1)  # records from data.path or a hub dataset (data.name)
    _only_one(problems, "data.path (a file, folder or glob) or data.name (a hub dataset) must be set",
              "data.kind=sft")
    assert not [p for p in C.validate(compose(["data=sft", "data.name=org/alpaca"]), 1) if "data." in p]


def test_check_passes_a_valid_config(compose):
    dims, cls, tokenizer, info = check(compose(["train.global_batch_size=32"]), 4)
    assert (dims.dp_replicate, dims.dp_size, dims.world_size) == (4, 4, 4)
    assert cls.name == "ddp"
    assert info.max_positions == 1024 and info.vocab_size == 264  # 258 embedded tokens padded to 8
    assert len(tokenizer) == 258


def test_grad_accumulation_steps(compose):
    cfg = compose(["train.global_batch_size=32", "train.micro_batch_size=4"])
    assert C.grad_accumulation_steps(cfg, 2) == 4
    assert C.batch_problems(cfg, 2) == []
    assert C.batch_problems(cfg, 3) != []


def test_check_heads_not_dividing_hidden_is_a_config_problem(compose):
    """validate() reports model.hidden_size % model.num_heads, but check() then calls registry.describe, whose
    LlamaConfig(...) raises a non-ModelError, so the user gets a traceback and loses the other problems."""
    cfg = compose(["model.num_heads=7", "optim.lr=-1"])
    problems = _check_problems(cfg, 1)
    _only_one(problems, "model.hidden_size=256", "model.num_heads=7")
    _only_one(problems, "optim.lr=-1")


def test_export_dtype_defaults_to_fp32_and_takes_only_known_dtypes(compose):
    assert compose().export.dtype == "fp32"
    for dtype in ("fp32", "bf16", "fp16"):
        assert C.validate(compose([f"export.dtype={dtype}"]), 1) == []
    problems = _check_problems(compose(["export.dtype=float8"]), 1)
    assert "fp32, bf16, fp16" in _only_one(problems, "export.dtype='float8'")


def test_check_hf_without_name_or_path_is_a_config_problem(compose):
    cfg = compose(["model=hf"])
    problems = _check_problems(cfg, 1)
    _only_one(problems, "model.name_or_path must be set")


# ---------------------------------------------------------------------------------------------------------
# ParallelDims

def _degrees(dp_replicate=1, dp_shard=1, tp=1, pp=1):
    return SimpleNamespace(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp)


@pytest.mark.parametrize("degrees,world,expected", [
    (dict(dp_replicate=-1), 8, (8, 1, 1, 1)),
    (dict(dp_replicate=-1, tp=2), 8, (4, 1, 2, 1)),
    (dict(dp_replicate=2, dp_shard=-1, tp=2), 8, (2, 2, 2, 1)),
    (dict(dp_replicate=1, tp=2, pp=-1), 8, (1, 1, 2, 4)),
    (dict(dp_replicate=-1), 1, (1, 1, 1, 1)),
    (dict(dp_replicate=2, dp_shard=2), 4, (2, 2, 1, 1)),
])
def test_parallel_dims_fill(degrees, world, expected):
    dims = ParallelDims.from_config(_degrees(**degrees), world)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == expected
    assert dims.world_size == world
    assert dims.dp_replicate * dims.dp_shard * dims.tp * dims.pp == world
    assert dims.dp_size == expected[0] * expected[1]
    assert dims.dp_enabled == (dims.dp_size > 1)
    assert dims.tp_enabled == (expected[2] > 1) and dims.pp_enabled == (expected[3] > 1)


def test_parallel_dims_product_mismatch():
    problems = ParallelDims.problems(_degrees(dp_replicate=2, tp=2), 8)
    assert len(problems) == 1
    assert "multiply to 4" in problems[0] and "world size is 8" in problems[0]
    assert "strategy.dp_replicate=2" in problems[0] and "strategy.tp=2" in problems[0]
    with pytest.raises(ConfigError) as info:
        ParallelDims.from_config(_degrees(dp_replicate=2, tp=2), 8)
    assert info.value.problems == problems


def test_parallel_dims_fill_not_divisible():
    problems = ParallelDims.problems(_degrees(dp_replicate=-1, tp=3), 8)
    assert len(problems) == 1 and "not divisible" in problems[0] and "strategy.tp=3" in problems[0]


def test_parallel_dims_two_fills():
    problems = ParallelDims.problems(_degrees(dp_replicate=-1, dp_shard=-1), 4)
    assert len(problems) == 1
    assert "only one degree may be -1" in problems[0]
    assert "strategy.dp_replicate" in problems[0] and "strategy.dp_shard" in problems[0]
    with pytest.raises(ConfigError):
        ParallelDims.from_config(_degrees(dp_replicate=-1, dp_shard=-1), 4)


@pytest.mark.parametrize("bad", [0, -2])
def test_parallel_dims_invalid_degree(bad):
    problems = ParallelDims.problems(_degrees(tp=bad), 4)
    assert any(f"strategy.tp={bad}" in p for p in problems), problems


def test_parallel_dims_dp_coordinates():
    # mesh (pp, dp_replicate, dp_shard, tp), tp innermost: ranks 0,1 share dp rank 0 under tp=2
    dims = ParallelDims.from_config(_degrees(dp_replicate=-1, tp=2), 8)
    assert [dims.dp_coordinates(r)[0] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    dims = ParallelDims.from_config(_degrees(dp_replicate=2, tp=2, pp=2), 8)
    assert [dims.dp_coordinates(r)[0] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


# ---------------------------------------------------------------------------------------------------------
# Range checks: every numeric key of the schema has one, and all of them are reported together.

RANGE_CASES = [
    # (override, expected message fragment)
    ("strategy.powersgd_rank=0", "strategy.powersgd_rank=0 must be > 0"),
    ("strategy.powersgd_warmup_steps=1", "strategy.powersgd_warmup_steps=1 must be >= 2"),
    ("strategy.zero_hpz_partition_size=0", "strategy.zero_hpz_partition_size=0 must be > 0"),
    ("sync.every=0", "sync.every=0 must be > 0"),
    ("peft.r=0", "peft.r=0 must be > 0"),
    ("data.follow_replay=1", "data.follow_replay=1.0 must be in [0, 1)"),
    ("data.follow_poll_s=0", "data.follow_poll_s=0.0 must be > 0"),
    ("data.follow_idle_timeout_s=-1", "data.follow_idle_timeout_s=-1.0 must be >= 0"),
    ("train.max_time_s=-5", "train.max_time_s=-5.0 must be >= 0"),
    ("peft.alpha=-1", "peft.alpha=-1.0 must be > 0"),
    ("peft.dropout=1", "peft.dropout=1.0 must be in [0, 1)"),
    ("sync.outer_lr=0", "sync.outer_lr=0.0 must be > 0"),
    ("sync.outer_momentum=1", "sync.outer_momentum=1.0 must be in [0, 1)"),
    ("model.hidden_size=0", "model.hidden_size=0 must be > 0"),
    ("model.num_layers=-1", "model.num_layers=-1 must be > 0"),
    ("model.num_heads=0", "model.num_heads=0 must be > 0"),
    ("model.num_kv_heads=0", "model.num_kv_heads=0 must be > 0"),
    ("model.intermediate_size=-64", "model.intermediate_size=-64 must be > 0"),
    ("model.max_position_embeddings=0", "model.max_position_embeddings=0 must be > 0"),
    ("model.rope_theta=-1", "model.rope_theta=-1.0 must be > 0"),
    ("objective.beta=0", "objective.beta=0.0 must be > 0"),
    ("objective.label_smoothing=0.5", "objective.label_smoothing=0.5 must be in [0, 0.5)"),
    ("objective.sft_weight=-1", "objective.sft_weight=-1.0 must be >= 0 (0 = none)"),
    ("objective.simpo_gamma=-1", "objective.simpo_gamma=-1.0 must be >= 0"),
    ("model.router_aux_loss_coef=-0.01",
     "model.router_aux_loss_coef=-0.01 must be >= 0 (0 = off; null = the model config's own)"),
    ("model.initializer_range=0", "model.initializer_range=0.0 must be > 0"),
    ("data.seq_len=0", "data.seq_len=0 must be > 0"),
    ("data.temperature=0", "data.temperature=0.0 must be > 0"),
    ("export.snapshot_every=-1", "export.snapshot_every=-1 must be >= 0 (0 = off)"),
    ("export.snapshot_keep=1", "export.snapshot_keep=1 must be >= 2"),
    ("data.val_fraction=1.0", "data.val_fraction=1.0 must be in [0, 1)"),
    ("data.val_fraction=-0.1", "data.val_fraction=-0.1 must be in [0, 1)"),
    ("data.split_seed=-1", "data.split_seed=-1 must be >= 0"),
    ("data.embedded_documents=0", "data.embedded_documents=0 must be > 0"),
    ("data.max_records=0", "data.max_records=0 must be > 0"),
    ("data.max_document_chars=0", "data.max_document_chars=0 must be > 0"),
    ("strategy.pp_stages_per_rank=0", "strategy.pp_stages_per_rank=0 must be > 0"),
    ("strategy.zero_stage=4", "strategy.zero_stage=4 must be one of 0, 1, 2, 3"),
    ("strategy.reduce_bucket_size=0", "strategy.reduce_bucket_size=0.0 must be > 0"),
    ("strategy.allgather_bucket_size=-1", "strategy.allgather_bucket_size=-1.0 must be > 0"),
    ("strategy.stage3_prefetch_bucket_size=-1", "strategy.stage3_prefetch_bucket_size=-1.0 must be >= 0"),
    ("strategy.stage3_param_persistence_threshold=-1", "strategy.stage3_param_persistence_threshold=-1.0 must be >= 0"),
    ("strategy.bucket_cap_mb=0", "strategy.bucket_cap_mb=0.0 must be > 0"),
    ("strategy.replica_groups=0", "strategy.replica_groups=0 must be > 0"),
    ("strategy.replica_group=-2", "strategy.replica_group=-2 must be >= -1"),
    ("strategy.min_replica_groups=0", "strategy.min_replica_groups=0 must be > 0"),
    ("optim.lr=0", "optim.lr=0.0 must be > 0"),
    ("optim.lr=nan", "optim.lr=nan must be a finite number"),
    ("optim.lr=inf", "optim.lr=inf must be a finite number"),
    ("optim.weight_decay=-5", "optim.weight_decay=-5.0 must be >= 0"),
    ("optim.eps=-1", "optim.eps=-1.0 must be > 0"),
    ("optim.momentum=1.0", "optim.momentum=1.0 must be in [0, 1)"),
    ("optim.betas=[0.9,nan]", "optim.betas=[0.9, nan] must be two numbers in [0, 1)"),
    ("scheduler.warmup_steps=-1", "scheduler.warmup_steps=-1 must be >= 0"),
    ("scheduler.min_lr_ratio=1.5", "scheduler.min_lr_ratio=1.5 must be in [0, 1]"),
    ("precision.init_scale=0", "precision.init_scale=0.0 must be > 0"),
    ("precision.growth_interval=0", "precision.growth_interval=0 must be > 0"),
    ("precision.growth_factor=1.0", "precision.growth_factor=1.0 must be > 1"),
    ("precision.backoff_factor=1.0", "precision.backoff_factor=1.0 must be in (0, 1)"),
    ("train.max_steps=0", "train.max_steps=0 must be > 0"),
    ("train.global_batch_size=-8", "train.global_batch_size=-8 must be > 0"),
    ("train.micro_batch_size=0", "train.micro_batch_size=0 must be > 0"),
    ("train.seed=-1", "train.seed=-1 must be >= 0"),
    ("train.log_every=0", "train.log_every=0 must be > 0"),
    ("train.grad_clip=-1", "train.grad_clip=-1.0 must be >= 0 (0 disables clipping)"),
    ("train.collective_timeout_s=0", "train.collective_timeout_s=0.0 must be > 0"),
    ("train.max_restarts=-1", "train.max_restarts=-1 must be >= 0"),
    ("train.activation_checkpointing_every=0", "train.activation_checkpointing_every=0 must be > 0"),
    ("train.loss_spike_factor=0.5", "train.loss_spike_factor=0.5 must be 0 (off) or > 1"),
    ("eval.every=-1", "eval.every=-1 must be >= 0"),
    ("eval.max_sequences=-5", "eval.max_sequences=-5 must be >= 0 (0 = all)"),
    ("checkpoint.every=-1", "checkpoint.every=-1 must be >= 0"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last=-1 must be >= 0 (0 keeps every checkpoint)"),
    ("logging.peak_tflops=0", "logging.peak_tflops=0.0 must be > 0"),
]


@pytest.mark.parametrize("override,expected", RANGE_CASES, ids=[c[0] for c in RANGE_CASES])
def test_range_checks(compose, override, expected):
    problems = C.validate(compose([override]), 2)
    hits = [p for p in problems if expected in p]
    assert len(hits) == 1, (expected, problems)


def _numeric_keys():
    """Every int / float (or Optional / List of them) field of the schema, as section.key, by walking the
    dataclasses: a new numeric key without a range check fails test_every_numeric_key_has_a_range_check."""
    import typing

    keys = []
    for section in fields(C.TesseraConfig):
        for f in fields(section.default_factory):
            tp = f.type if not isinstance(f.type, str) else eval(f.type, vars(C), {"List": typing.List,
                                                                                   "Optional": typing.Optional})
            inner = {a for a in typing.get_args(tp) if a is not type(None)} or {tp}
            while any(typing.get_origin(a) in (list, typing.List) for a in inner):
                inner = {b for a in inner for b in (typing.get_args(a) or (a,))}
            if inner & {int, float}:
                keys.append(f"{section.name}.{f.name}")
    return keys


def test_every_numeric_key_has_a_range_check():
    keys = _numeric_keys()
    assert "optim.eps" in keys and "strategy.pp_split_points" in keys and "logging.peak_tflops" in keys
    assert "train.compile" not in keys  # bools are not numbers here
    missing = [k for k in keys if k not in C.RANGES and k not in C.RANGE_CHECKED_ELSEWHERE]
    assert not missing, f"numeric keys without a range check in trainer/config/schema.py RANGES: {missing}"
    stale = [k for k in list(C.RANGES) + list(C.RANGE_CHECKED_ELSEWHERE) if k not in keys]
    assert not stale, stale
    covered = {o.split("=")[0] for o, _ in RANGE_CASES}
    untested = [k for k in C.RANGES if k not in covered]
    assert not untested, f"keys of RANGES without a row in RANGE_CASES: {untested}"


def test_defaults_pass_the_range_checks(compose):
    assert C.range_problems(compose([])) == []
    for preset in ("strategy=zero3_offload", "strategy=pp", "precision=fp16", "optim=sgd", "model=hf"):
        assert C.range_problems(compose([preset])) == [], preset


def test_degrees_checked_elsewhere_reject_nonsense():
    for key in ("dp_replicate", "dp_shard", "tp", "pp"):
        problems = ParallelDims.problems(_degrees(**{key: 0}), 1)
        assert any(f"strategy.{key}=0 must be a positive degree" in p for p in problems), problems


def test_all_range_problems_reported_together(compose):
    cfg = compose(["eval.max_sequences=-5", "checkpoint.keep_last=-1", "optim.weight_decay=-5", "optim.eps=-1",
                   "train.loss_spike_factor=-2"])
    problems = _check_problems(cfg, 1)
    for key in ("eval.max_sequences=-5", "checkpoint.keep_last=-1", "optim.weight_decay=-5.0", "optim.eps=-1.0",
                "train.loss_spike_factor=-2.0"):
        _only_one(problems, key)
    assert len(problems) == 5, problems


# ---------------------------------------------------------------------------------------------------------
# Runtime faults translated at the boundary (trainer/run/cli.py): one line, exit code 4; anything else re-raised.

def _exit_of(exc, env=None, monkeypatch=None):
    from trainer.run.cli import user_errors

    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as info:
        with user_errors():
            raise exc
    return info.value.code


@pytest.mark.parametrize("exc,needles", [
    (RuntimeError("[/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:28033: Connection reset by peer. This "
                  "is typically caused by a remote worker hanging"), ["rank 1 is gone", "Connection reset by peer"]),
    (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to "
                  "complete"), ["a collective timed out", "train.collective_timeout_s", "rank 1"]),
    (OSError(28, "No space left on device", "/runs/x/metrics.jsonl"),
     ["the disk is full", "/runs/x/metrics.jsonl", "hydra.run.dir"]),
    (OSError(30, "Read-only file system", "/runs/x/checkpoints"), ["read-only", "/runs/x/checkpoints"]),
], ids=["peer-reset", "gloo-timeout", "enospc", "erofs"])
def test_runtime_faults_become_one_line_and_exit_4(capsys, monkeypatch, exc, needles):
    assert _exit_of(exc, {"RANK": "0", "WORLD_SIZE": "2"}, monkeypatch) == 4
    err = capsys.readouterr().err
    assert err.startswith("[rank 0] error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)
    assert "Traceback" not in err


def test_debug_keeps_the_traceback_of_a_translated_fault(capsys, monkeypatch):
    assert _exit_of(OSError(28, "No space left on device", "/x"), {"TESSERA_DEBUG": "1"}, monkeypatch) == 4
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("exc", [RuntimeError("shape mismatch in matmul"), KeyError("x"),
                                 OSError(2, "No such file or directory", "/x")])
def test_unknown_errors_are_not_swallowed(exc):
    from trainer.run.cli import user_errors

    with pytest.raises(type(exc)):
        with user_errors():
            raise exc


def test_truncated_cache_entry_is_detected_and_rebuilt(tmp_path):
    import numpy as np

    from trainer.data.store import build_or_load, entry_damage

    notes = []
    docs = [(np.arange(10) % 7, None), (np.arange(5), None)]
    store = build_or_load(str(tmp_path), {"k": 1}, "text", 300, lambda: iter(docs), log=notes.append)
    assert entry_damage(store.path) is None and store.meta["files"]["tokens.bin"] == 30
    with open(f"{store.path}/tokens.bin", "r+b") as fh:
        fh.truncate(11)
    assert entry_damage(store.path) == "tokens.bin has 11 bytes, 30 expected"
    again = build_or_load(str(tmp_path), {"k": 1}, "text", 300, lambda: iter(docs), log=notes.append)
    assert any("is damaged (tokens.bin has 11 bytes, 30 expected); rebuilding it" in n for n in notes), notes
    assert list(again.tokens) == list(np.concatenate([d for d, _ in docs]))


@pytest.mark.parametrize("overrides,expected", [
    (["strategy=hsdp", "strategy.dp_replicate=2", "strategy.dp_shard=2", "sync=diloco"], None),
    (["strategy=ddp", "sync=local_sgd"], None),
    (["strategy=fsdp", "sync=local_sgd"], "sync=local_sgd is not available with strategy=fsdp; use strategy=ddp"),
    (["strategy=hsdp", "strategy.dp_replicate=2", "strategy.dp_shard=2", "strategy.cpu_offload=true",
      "sync=diloco"], "sync=diloco with strategy.cpu_offload=true is not supported"),
])
def test_periodic_sync_runs_with_ddp_and_hsdp_only(compose, overrides, expected):
    if expected is None:
        check(compose(overrides + ["train.micro_batch_size=4"]), 4)
    else:
        problems = _check_problems(compose(overrides), 4)
        assert len([p for p in problems if expected in p]) == 1, problems
