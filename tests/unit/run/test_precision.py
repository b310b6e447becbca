"""Buffers in the model's dtype (trainer/run/precision.py `cast_buffers_in_model_dtype`, models/init.py
`buffers_in_model_dtype`): where a wrapper casts the parameters to bf16 without autocast (FSDP's mixed-precision
policy, DeepSpeed's bf16), the buffers Hugging Face builds in the model's dtype follow, the fp32 ones stay."""
from __future__ import annotations

import pytest
import torch

from models.init import buffers_in_model_dtype, meta_model
from tests import archs
from trainer.run.precision import cast_buffers_in_model_dtype

DECAYS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


@pytest.mark.parametrize("arch,expected", [
    ("xglm", ["model.embed_positions.weights"]),
    ("minimax", [f"model.layers.{i}.self_attn.{b}" for i in (0, 2) for b in DECAYS]),  # the linear-attention layers
    ("llama", []),  # rotary inv_freq: computed in fp32 whatever the dtype
    ("deepseek_v3", []),  # e_score_correction_bias: fp32 explicitly
    ("gemma3", []),  # embed_scale: 0-dim
    ("apertus", []),  # xIELU beta / eps: 0-dim
])
def test_buffers_in_model_dtype_are_those_hugging_face_builds_in_it(arch, expected):
    before = torch.get_default_dtype()
    assert sorted(buffers_in_model_dtype(archs.make_config(arch))) == sorted(expected)
    assert torch.get_default_dtype() == before


def test_meta_model_in_bf16_keeps_the_rotary_table_in_fp32():
    model = meta_model(archs.make_config("llama"), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def _model(arch):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(archs.make_config(arch)).float().eval()


def _cast_parameters(model, dtype):
    """What FSDP's mixed-precision policy and DeepSpeed's bf16 do: the parameters only, no autocast."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


@pytest.mark.parametrize("arch", ["xglm", "minimax"])
def test_a_bf16_forward_needs_the_cast_and_computes_what_hugging_face_bf16_computes(arch):
    from transformers import AutoModelForCausalLM

    model = _model(arch)
    ids = torch.randint(0, archs.VOCAB, (2, 24))
    _cast_parameters(model, torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):  # an fp32 table meets bf16 activations and weights
        model(input_ids=ids)
    cast_buffers_in_model_dtype([model], torch.bfloat16)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert got.dtype == torch.bfloat16
    names = set(buffers_in_model_dtype(model.config))
    for name, b in model.named_buffers():
        assert b.dtype == (torch.bfloat16 if name in names else torch.float32), name
    # Hugging Face's own bf16 model of the same weights: the same logits (the same buffers, values and dtype)
    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16).eval()
    reference.load_state_dict(_model(arch).to(torch.bfloat16).state_dict(), strict=False)
    with torch.no_grad():
        assert torch.equal(reference(input_ids=ids).logits, got)


def test_fp32_leaves_the_model_alone_and_peft_models_are_cast_under_their_base():
    import peft

    model = _model("xglm")
    table = model.model.embed_positions.weights
    cast_buffers_in_model_dtype([model], torch.float32)
    cast_buffers_in_model_dtype([model], None)
    assert model.model.embed_positions.weights is table and table.dtype == torch.float32
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    stage = _model("xglm")  # another part of the same model (a rank's second pipeline stage): cast with it
    cast_buffers_in_model_dtype([adapted, stage], torch.bfloat16)
    assert model.model.embed_positions.weights.dtype == torch.bfloat16
    assert stage.model.embed_positions.weights.dtype == torch.bfloat16
    assert {p.dtype for p in adapted.parameters()} == {torch.float32}
