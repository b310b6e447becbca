"""Seeded initial weights by init unit (models/init.py): complete, deterministic, independent of the other
units, and with Hugging Face's own init rules."""
from __future__ import annotations

import math

import torch

from models import registry
from models.init import initial_weights, meta_model
from models.tokenizer import embedded_tokenizer
from trainer.config.schema import ModelConfig


def _info(**kw):
    base = dict(kind="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                max_position_embeddings=64)
    base.update(kw)
    return registry.describe(ModelConfig(**base), embedded_tokenizer())


def _flatten(units):
    out = {}
    for values in units:
        assert not set(values) & set(out), "a tensor appears in two units"
        out.update(values)
    return out


def test_every_parameter_once_in_blocks_plus_one_unit():
    info = _info(num_layers=3)
    units = list(initial_weights(info.hf_config, 0))
    assert len(units) == 3 + 1  # one per decoder block, then embeddings / final norm / rotary table
    assert all(k.startswith(f"model.layers.{i}.") for i, u in enumerate(units[:3]) for k in u)
    values = _flatten(units)
    model = meta_model(info.hf_config)
    params = dict(model.named_parameters())
    assert set(params) <= set(values)
    assert {k: list(v.shape) for k, v in values.items() if k in params} == \
        {k: list(v.shape) for k, v in params.items()}
    # the rotary inverse frequencies: a non-persistent buffer the initialization computes
    head_dim = 64 // 4
    expected = 1.0 / (ModelConfig().rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    torch.testing.assert_close(values["model.rotary_emb.inv_freq"], expected)
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in values.values())


def test_registry_build_holds_the_same_values():
    info = _info()
    model = registry.build(ModelConfig(kind="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                       intermediate_size=128, max_position_embeddings=64), info, seed=3)
    values = _flatten(initial_weights(info.hf_config, 3))
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        assert torch.equal(tensor, values[name]), name


def test_a_unit_does_not_depend_on_the_others_or_on_the_global_rng():
    torch.manual_seed(1)
    two = _flatten(initial_weights(_info(num_layers=2).hf_config, 7))
    torch.manual_seed(2)
    torch.rand(10)
    four = _flatten(initial_weights(_info(num_layers=4).hf_config, 7))
    for name, value in two.items():  # layers 0-1 and the embeddings are the same in a deeper model
        assert torch.equal(value, four[name]), name
    other_seed = _flatten(initial_weights(_info(num_layers=2).hf_config, 8))
    assert not torch.equal(two["model.layers.0.self_attn.q_proj.weight"],
                           other_seed["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(two["model.layers.0.self_attn.q_proj.weight"], two["model.layers.1.self_attn.q_proj.weight"])


def test_hugging_face_init_rules():
    info = _info(initializer_range=0.05, num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4)
    values = _flatten(initial_weights(info.hf_config, 0))
    assert abs(values["model.layers.0.mlp.up_proj.weight"].std().item() - 0.05) < 0.003
    assert torch.equal(values["model.norm.weight"], torch.ones(128))
    pad = embedded_tokenizer().pad_token_id
    assert torch.count_nonzero(values["model.embed_tokens.weight"][pad]) == 0  # padding row zeroed
    # GPT-2: residual projections scaled by 1/sqrt(2 x layers), biases zero, applied after the plain Conv1D init
    gpt2 = _info(kind="gpt2", num_kv_heads=None, hidden_size=128, num_layers=8, intermediate_size=512,
                 initializer_range=0.02)
    g = _flatten(initial_weights(gpt2.hf_config, 0))
    assert abs(g["transformer.h.3.mlp.c_proj.weight"].std().item() - 0.02 / math.sqrt(16)) < 0.0005
    assert abs(g["transformer.h.3.mlp.c_fc.weight"].std().item() - 0.02) < 0.001
    assert torch.count_nonzero(g["transformer.h.3.attn.c_attn.bias"]) == 0


def test_tied_embeddings_appear_once():
    info = _info(tie_word_embeddings=True)
    values = _flatten(initial_weights(info.hf_config, 0))
    assert "model.embed_tokens.weight" in values and "lm_head.weight" not in values
    model = registry.build(ModelConfig(kind="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                       intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=True),
                           info, seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, values["model.embed_tokens.weight"])
