"""Tiny random models of many transformers architectures, generated in code (no downloads).

`ARCHITECTURES` maps a name to a function returning a small config of that architecture (hidden 64, 4 decoder
layers so that pp=2 puts 2 on each stage, 4 heads, 2 key/value heads where the architecture has grouped-query
attention, intermediate 128, vocabulary 320, dropout off). `make_model_folder(name, path)` writes a seeded
random model of it with the embedded tokenizer, so that `model=hf model.name_or_path=<path>` trains it with
its own tokenizer.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

HIDDEN = 64
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
VOCAB = 320  # >= the embedded tokenizer's 258 tokens; divides by 2 and 4 (tensor-parallel vocabulary splits)
POSITIONS = 256
SLIDING_WINDOW = 16  # below the tests' data.seq_len=32, so the window really masks something


@lru_cache(maxsize=1)
def token_ids() -> dict:
    """bos/eos/pad ids of the embedded tokenizer (the model folders carry it)."""
    from models.tokenizer import embedded_tokenizer

    tok = embedded_tokenizer()
    return dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _common(**kw):
    return dict(**token_ids(), vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, intermediate_size=INTERMEDIATE, max_position_embeddings=POSITIONS, **kw)


def llama():
    from transformers import LlamaConfig

    return LlamaConfig(**_common(num_key_value_heads=KV_HEADS, attention_dropout=0.0))


def llama_tied():
    """Llama with the input embedding and the LM head tied (one weight; under pp a copy on the last stage)."""
    from transformers import LlamaConfig

    return LlamaConfig(**_common(num_key_value_heads=KV_HEADS, attention_dropout=0.0, tie_word_embeddings=True))


def qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**_common(num_key_value_heads=KV_HEADS, attention_dropout=0.0))


def qwen3():
    from transformers import Qwen3Config

    # Layers 2 and 3 attend within a sliding window (Qwen3's layer_types), 0 and 1 to the full context.
    return Qwen3Config(**_common(num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, attention_dropout=0.0,
                                 use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=2,
                                 layer_types=["full_attention", "full_attention", "sliding_attention",
                                              "sliding_attention"]))


def mistral():
    from transformers import MistralConfig

    return MistralConfig(**_common(num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, sliding_window=SLIDING_WINDOW,
                                   attention_dropout=0.0))


def gemma2():
    from transformers import Gemma2Config

    # Softcapping of attention logits and final logits, alternating sliding/full layers.
    return Gemma2Config(**_common(num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                                  sliding_window=SLIDING_WINDOW, attention_dropout=0.0))


def gemma3():
    from transformers import Gemma3TextConfig

    # Text-only causal LM (Gemma3ForCausalLM); sliding layers every other layer (the full model: 5 of 6).
    return Gemma3TextConfig(**_common(num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                                      sliding_window=SLIDING_WINDOW, attention_dropout=0.0,
                                      layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2)))


def phi3():
    from transformers import Phi3Config

    # Fused qkv_proj and gate_up_proj.
    return Phi3Config(**_common(num_key_value_heads=KV_HEADS, attention_dropout=0.0, resid_pdrop=0.0,
                                embd_pdrop=0.0))


def gpt2():
    from transformers import GPT2Config

    # Conv1D projections, learned positions, tied embeddings; no grouped-query attention.
    return GPT2Config(**token_ids(), vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                      n_inner=INTERMEDIATE, n_positions=POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def gpt_neox():
    from transformers import GPTNeoXConfig

    # Fused query_key_value, partial rotary, parallel residual; no grouped-query attention.
    return GPTNeoXConfig(**_common(rotary_pct=0.25, attention_dropout=0.0, hidden_dropout=0.0))


def opt():
    from transformers import OPTConfig

    # Learned positions with an offset of 2, biases, tied embeddings; no grouped-query attention.
    return OPTConfig(**token_ids(), vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, ffn_dim=INTERMEDIATE, word_embed_proj_dim=HIDDEN,
                     max_position_embeddings=POSITIONS, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                     layerdrop=0.0)


def olmo2():
    from transformers import Olmo2Config

    # Norms after attention/MLP and q/k norms over all heads.
    return Olmo2Config(**_common(num_key_value_heads=KV_HEADS, attention_dropout=0.0))


def mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(**_common(num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_local_experts=4,
                                   num_experts_per_tok=2, attention_dropout=0.0, router_jitter_noise=0.0))


def qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_common(num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=INTERMEDIATE // 2,
                                    decoder_sparse_step=1, attention_dropout=0.0))


def granite():
    from transformers import GraniteConfig

    # Multipliers in the model's forward, not in modules: embeddings x2 before the first block, residuals,
    # attention scale, logits x 2 (/ logits_scaling) after the head.
    return GraniteConfig(**_common(num_key_value_heads=KV_HEADS, embedding_multiplier=2.0, residual_multiplier=0.5,
                                   attention_multiplier=0.1, logits_scaling=0.5, attention_dropout=0.0))


def bloom():
    from transformers import BloomConfig

    # ALiBi (no position ids), a norm of the embeddings before the first block, fused query_key_value, tied.
    return BloomConfig(**token_ids(), vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                       hidden_dropout=0.0, attention_dropout=0.0)


def llama4():
    from transformers import Llama4TextConfig

    # Text-only Llama 4: mixture-of-experts every other layer (one routed expert + a shared one), layers without
    # rope attend in chunks of 16 tokens; its causal LM names `language_model` as its base model but holds `model`.
    return Llama4TextConfig(**_common(num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                      intermediate_size_mlp=INTERMEDIATE, num_local_experts=4, num_experts_per_tok=1,
                                      interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1],
                                      attention_chunk_size=16, attention_dropout=0.0))


def gpt_oss():
    from transformers import GptOssConfig

    # Attention sinks (one learned logit per head), biases, sliding/full layers, fused 3-D experts.
    return GptOssConfig(**_common(num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_local_experts=4,
                                  num_experts_per_tok=2, sliding_window=SLIDING_WINDOW, attention_dropout=0.0,
                                  layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2)))


def deepseek_v3():
    from transformers import DeepseekV3Config

    # Multi-head latent attention (low-rank query and joint key/value projections, a rotary key shared by the
    # heads), a dense first layer, then routed experts (sigmoid scores, a correction bias) beside a shared expert.
    return DeepseekV3Config(**_common(num_key_value_heads=HEADS, n_routed_experts=4, num_experts_per_tok=2,
                                      n_shared_experts=1, moe_intermediate_size=INTERMEDIATE // 4,
                                      first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                      qk_nope_head_dim=8, v_head_dim=HEAD_DIM, n_group=1, topk_group=1,
                                      attention_dropout=0.0, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0}))


def qwen3_5():
    from transformers import Qwen3_5TextConfig

    # Qwen3.5's text model: gated delta-net linear attention (a causal convolution over the sequence, a recurrent
    # scan) in layers 0-2, gated full attention with partial rotary embeddings in layer 3.
    return Qwen3_5TextConfig(**_common(num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, linear_num_key_heads=2,
                                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                       attention_dropout=0.0,
                                       layer_types=["linear_attention"] * (LAYERS - 1) + ["full_attention"]))


def lfm2():
    from transformers import Lfm2Config

    # LFM2: gated short convolutions over the sequence in layers 0 and 2, attention with q/k norms in 1 and 3; its
    # final norm is named `embedding_norm`; tied embeddings.
    return Lfm2Config(**_common(num_key_value_heads=KV_HEADS, block_ff_dim=INTERMEDIATE, block_auto_adjust_ff_dim=False,
                                layer_types=["conv", "full_attention"] * (LAYERS // 2)))


def apertus():
    from transformers import ApertusConfig

    # Apertus: the xIELU activation (learned scalars, 0-dim buffers in the checkpoint), q/k norms, an MLP without
    # a gate.
    return ApertusConfig(**_common(num_key_value_heads=KV_HEADS, attention_dropout=0.0))


ARCHITECTURES = OrderedDict((f.__name__, f) for f in (
    llama, llama_tied, qwen2, qwen3, mistral, gemma2, gemma3, phi3, gpt2, gpt_neox, opt, olmo2, mixtral, qwen3_moe,
    granite, bloom, llama4, gpt_oss, deepseek_v3, qwen3_5, lfm2, apertus))


def xglm():
    from transformers import XGLMConfig

    # XGLM: a sinusoidal position table, a buffer Hugging Face builds in the model's dtype (multi-dimensional:
    # it promotes what it is added to).
    return XGLMConfig(**token_ids(), vocab_size=VOCAB, d_model=HIDDEN, num_layers=LAYERS, attention_heads=HEADS,
                      ffn_dim=INTERMEDIATE, max_position_embeddings=POSITIONS, dropout=0.0, attention_dropout=0.0,
                      activation_dropout=0.0)


def minimax():
    from transformers import MiniMaxConfig

    # MiniMax: lightning (linear) attention in layers 0 and 2, whose decay tables are buffers in the model's dtype,
    # full attention in 1 and 3; a mixture of 4 experts.
    return MiniMaxConfig(**_common(num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_local_experts=4,
                                   num_experts_per_tok=2, attention_dropout=0.0,
                                   layer_types=["linear_attention", "full_attention"] * (LAYERS // 2)))


# Architectures outside the matrix, for the tests of what they alone have (buffers in the model's dtype).
MORE_ARCHITECTURES = OrderedDict((f.__name__, f) for f in (xglm, minimax))


def make_config(name: str):
    """The tiny config of architecture `name` (bos/eos/pad ids: the embedded tokenizer's)."""
    from models.tokenizer import embedded_tokenizer

    config = {**ARCHITECTURES, **MORE_ARCHITECTURES}[name]()
    assert len(embedded_tokenizer()) <= config.vocab_size, name
    for key, value in token_ids().items():
        assert getattr(config, key) == value, (name, key)
    return config


def make_model_folder(name: str, path, seed: int = 0) -> Path:
    """Write a random tiny model of architecture `name` (weights from `seed`) and the embedded tokenizer into
    `path` (save_pretrained); returns the path. A folder already holding it (`arch.json` matches) is kept."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.tokenizer import embedded_tokenizer

    path = Path(path)
    stamp = {"arch": name, "seed": seed}
    marker = path / "arch.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return path
    config = make_config(name)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    embedded_tokenizer().save_pretrained(path)
    marker.write_text(json.dumps(stamp))
    return path


# ---- the matrix the integration test runs (tests/integration/test_architectures.py) and the docs show -----------
LAYOUTS = ["single", "ddp", "zero2", "zero3", "fsdp", "tp", "pp", "cp", "ep"]
# Layouts for mixture-of-experts models only (expert parallelism): they run the architectures alone (no llama
# variants), and refuse the dense ones.
MOE_LAYOUTS = ("ep",)
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3")
# Architectures a layout refuses before training, with the words of the message that says why.
REFUSED = {
    ("gpt2", "tp"): "gpt2 architecture has no tensor-parallel plan",
    ("opt", "tp"): "opt architecture has no tensor-parallel plan",
    ("bloom", "tp"): "bloom architecture has no tensor-parallel plan",
    ("gpt_oss", "tp"): "tensor-parallel plan splits nothing inside the decoder blocks",
    ("bloom", "cp"): "forward takes no position_ids",
    ("qwen3_5", "cp"): "the qwen3_5_text model mixes tokens outside attention (its linear_attention layers)",
    ("lfm2", "tp"): "tensor-parallel plan splits nothing inside the decoder blocks",
    ("lfm2", "cp"): "the lfm2 model mixes tokens outside attention (its conv layers)",
    **{(name, "ep"): "needs a mixture-of-experts model whose experts are fused 3-D tensors"
       for name in ARCHITECTURES if name not in MOE_ARCHITECTURES},
    ("llama4", "ep"): "can't split llama4_text's Llama4TextExperts",
}
# Why, in the words of docs/strategies-and-layouts.md.
REFUSED_WHY = {
    ("gpt2", "tp"): "refused: fused Conv1D q/k/v, no TP plan",
    ("opt", "tp"): "refused: attention reshapes by the full head count, no TP plan",
    ("bloom", "tp"): "refused: fused query_key_value, no TP plan",
    ("gpt_oss", "tp"): "refused: its plan splits only the embeddings",
    ("bloom", "cp"): "refused: ALiBi, no position ids",
    ("qwen3_5", "cp"): "refused: linear attention mixes the sequence",
    ("lfm2", "tp"): "refused: its plan splits only the embeddings",
    ("lfm2", "cp"): "refused: short convolutions mix the sequence",
    **{(name, "ep"): "refused: dense (no experts)" for name in ARCHITECTURES if name not in MOE_ARCHITECTURES},
    ("llama4", "ep"): "refused: experts take routed tokens, not (tokens, top-k)",
}
# Layouts that run llama in fp16 (loss scaling): the reference and the pipeline, whose loss the schedule scales.
FP16_LAYOUTS = ("single", "pp")


def support_table() -> str:
    """The table of architectures x layouts in docs/strategies-and-layouts.md: every cell the matrix trains to fp32
    parity with one process (and exports), or the refusal it asserts."""
    head = "| architecture (tiny config in tests/archs.py) | " + " | ".join(LAYOUTS) + " |"
    lines = [head, "|---|" + "---|" * len(LAYOUTS)]
    for name in ARCHITECTURES:
        cells = [REFUSED_WHY.get((name, lay), "yes") for lay in LAYOUTS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
