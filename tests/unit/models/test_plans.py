"""Model-parallel plans (models/plans.py) and the degree/model checks of the model-parallel strategies: every
violation reported together, naming the keys to change."""
from __future__ import annotations

import pytest

from models import plans
from models.init import meta_model
from tests.conftest import compose_config
from trainer.run.build import check
from tessera.errors import ConfigError

SMALL = ["model.hidden_size=64", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
         "model.intermediate_size=128", "data.embedded_documents=50", "data.seq_len=32"]


def test_balanced_and_explicit_stage_layers():
    assert plans.stage_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert plans.stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]  # first stages take the extra
    assert plans.stage_layers(8, 3, [2, 6]) == [range(0, 2), range(2, 6), range(6, 8)]
    for layers, stages in ((8, 2), (7, 3), (5, 5)):
        ranges = plans.stage_layers(layers, stages)
        assert sum(len(r) for r in ranges) == layers and all(len(r) >= 1 for r in ranges)


def test_split_problems():
    assert plans.split_problems(4, 4, None) == []
    assert "at least one layer" in plans.split_problems(4, 5, None)[0]
    assert "2 entries" in plans.split_problems(8, 2, [2, 4])[0]
    assert "increasing" in plans.split_problems(8, 3, [4, 2])[0]
    assert "increasing" in plans.split_problems(8, 2, [8])[0]


def _model(overrides=()):
    from models import registry

    cfg = compose_config(SMALL + list(overrides))
    from models.tokenizer import embedded_tokenizer

    info = registry.describe(cfg.model, embedded_tokenizer())
    return meta_model(info.hf_config), info


def test_llama_tp_plan_covers_projections_embedding_and_head():
    model, _ = _model()
    plan = plans.tp_plan(model, 2)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["model.embed_tokens"] == "embedding_rowwise"
    assert plan["lm_head"] == "colwise_gather_output"
    assert set(plan.values()) <= set(plans.SUPPORTED_TP_STYLES)
    # a vocabulary that does not divide: embeddings and head stay whole
    assert "lm_head" not in plans.tp_plan(model, 3 if model.config.vocab_size % 3 else 7)


def test_tied_embeddings_stay_replicated_under_tp():
    model, _ = _model(["model.tie_word_embeddings=true"])
    plan = plans.tp_plan(model, 2)
    assert "model.embed_tokens" not in plan and "lm_head" not in plan


def test_pipeline_splits():
    llama, _ = _model()
    split = plans.pipeline_split(llama)
    assert (split.layers, split.first, split.last) == ("model.layers", ["model.embed_tokens"],
                                                       ["model.norm", "lm_head"])
    gpt2, _ = _model(["model=gpt2_10m", "model.num_kv_heads=null", "model.hidden_size=64", "model.num_layers=4",
                      "model.num_heads=4"])
    split = plans.pipeline_split(gpt2)
    assert split.layers == "transformer.h" and split.zeroed_on_later_stages == ["transformer.wpe"]


@pytest.mark.parametrize("arch,first,last", [
    # LFM2's final norm is named embedding_norm but declared (and run) after the blocks
    ("lfm2", ["model.embed_tokens"], ["model.embedding_norm", "lm_head"]),
    # Bloom's norm of the embeddings runs before them
    ("bloom", ["transformer.word_embeddings", "transformer.word_embeddings_layernorm"],
     ["transformer.ln_f", "lm_head"]),
    # OPT declares its input projection and its final norm before the blocks
    ("opt", ["model.decoder.embed_tokens", "model.decoder.embed_positions"], ["model.decoder.final_layer_norm",
                                                                               "lm_head"]),
])
def test_pipeline_split_puts_embedding_named_modules_where_they_run(arch, first, last):
    from tests.archs import make_config

    split = plans.pipeline_split(meta_model(make_config(arch)))
    assert (split.first, split.last) == (first, last)


def _problems(overrides, world_size):
    with pytest.raises(ConfigError) as e:
        check(compose_config(SMALL + overrides), world_size)
    return e.value.problems


def test_every_model_parallel_violation_is_reported_together():
    problems = _problems(["strategy=3d", "strategy.tp=8", "strategy.pp=2", "strategy.dp_shard=1",
                          "model.num_layers=1"], 16)
    text = "\n".join(problems)
    assert "strategy.tp=8 must divide the attention heads (4)" in text
    assert "strategy.tp=8 must divide the key/value heads (2)" in text
    assert "need at least one layer each" in text and "strategy.pp" in text


def test_degrees_must_multiply_to_the_world_size():
    text = "\n".join(_problems(["strategy=fsdp_tp", "strategy.tp=2", "strategy.dp_shard=3"], 4))
    assert "multiply to 6" in text and "world size is 4" in text


def test_schedule_needs_enough_micro_batches():
    text = "\n".join(_problems(["strategy=pp", "strategy.pp_schedule=zbv", "train.global_batch_size=4",
                                "train.micro_batch_size=2"], 2))
    assert "needs at least 4 micro-batches" in text and "train.global_batch_size" in text
    text = "\n".join(_problems(["strategy=pp", "strategy.pp_schedule=1f1b", "train.global_batch_size=2",
                                "train.micro_batch_size=2"], 2))
    assert "needs at least 2 micro-batches" in text


def test_unknown_schedule_and_unsupported_combinations():
    text = "\n".join(_problems(["strategy=pp", "strategy.pp_schedule=bogus"], 2))
    assert "strategy.pp_schedule='bogus' is not one of" in text
    text = "\n".join(_problems(["strategy=pp", "model.tie_word_embeddings=true", "train.compile=true"], 2))
    # tied embeddings are supported across stages (a copy on the last stage, gradients summed)
    assert "tie_word_embeddings" not in text and "train.compile=true is not supported with pipeline" in text
    text = "\n".join(_problems(["strategy=tp", "model=gpt2_10m", "model.num_kv_heads=null"], 2))
    assert "gpt2 architecture has no tensor-parallel plan" in text
    text = "\n".join(_problems(["strategy=tp", "strategy.sequence_parallel=true", "data.seq_len=33"], 2))
    assert "data.seq_len=33" in text


def test_valid_layouts_pass():
    for overrides, world in ((["strategy=tp"], 2), (["strategy=pp", "strategy.pp_schedule=interleaved_1f1b"], 2),
                             (["strategy=fsdp_tp"], 4), (["strategy=pp_fsdp"], 4), (["strategy=3d"], 8)):
        check(compose_config(SMALL + overrides + ["train.micro_batch_size=2"]), world)


def test_learned_activations_beside_split_projections_sum_their_gradient_over_the_ranks():
    """Apertus' xIELU scalars act on a rank's columns of the up-projection: replicated, gradient all-reduced;
    activations without parameters (Llama's SiLU) are not in the plan."""
    from tests.archs import make_config

    plan = plans.tp_plan(meta_model(make_config("apertus")), 2)
    assert plan["model.layers.*.mlp.act_fn"] == "replicated_with_grad_allreduce"
    assert plan["model.layers.*.mlp.up_proj"] == "colwise"
    assert not any("act_fn" in k for k in plans.tp_plan(meta_model(make_config("llama")), 2))
