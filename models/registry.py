"""Model registry: a model kind -> how to describe it (before any process group), build it and load its
tokenizer. Later strategies add tensor-parallel plans and pipeline splits to the same spec.

Model code here holds no distributed code: strategies parallelize what `build` returns.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Dict

import torch

from models.init import copy_full_tensors, initial_weights, meta_model, text_config
from models.loading import causal_lm_class, load_message
from models.lora import full_shape
from models.packing import takes_position_ids
from models.tokenizer import embedded_tokenizer
from models.weights import PretrainedWeights
from tessera.errors import ModelError, one_line

VOCAB_MULTIPLE = 8  # presets pad the embedding table so that later tensor-parallel splits divide it


@dataclass
class ModelInfo:
    """What validation and metrics need to know before any weights exist."""

    hf_config: object  # transformers.PretrainedConfig
    max_positions: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int


@dataclass(frozen=True)
class ModelSpec:
    kind: str
    make_config: Callable  # (model_cfg, tokenizer) -> PretrainedConfig, with model_cfg.attn_implementation if set
    pretrained: bool


_REGISTRY: Dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> None:
    if spec.kind in _REGISTRY:
        raise ValueError(f"model kind {spec.kind!r} is registered twice")
    _REGISTRY[spec.kind] = spec


def get_spec(kind: str) -> ModelSpec:
    if kind not in _REGISTRY:
        raise ModelError(f"model.kind={kind!r} is unknown; known kinds: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[kind]


def _padded_vocab(tokenizer) -> int:
    n = len(tokenizer)
    return (n + VOCAB_MULTIPLE - 1) // VOCAB_MULTIPLE * VOCAB_MULTIPLE


def _attention(m) -> dict:
    """Config keyword arguments for an explicit model.attn_implementation; null leaves it to transformers (what
    the model supports)."""
    return {"attn_implementation": m.attn_implementation} if m.attn_implementation else {}


def _llama_config(m, tokenizer):
    from transformers import LlamaConfig

    inter = m.intermediate_size or ((8 * m.hidden_size // 3 + 63) // 64 * 64)
    return LlamaConfig(
        vocab_size=_padded_vocab(tokenizer), hidden_size=m.hidden_size, intermediate_size=inter,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads or m.num_heads, max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings, initializer_range=m.initializer_range,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **_attention(m),
    )


def _gpt2_config(m, tokenizer):
    from transformers import GPT2Config

    if m.num_kv_heads not in (None, m.num_heads):
        raise ModelError("model.kind=gpt2 has no grouped-query attention: leave model.num_kv_heads null")
    return GPT2Config(
        vocab_size=_padded_vocab(tokenizer), n_embd=m.hidden_size, n_layer=m.num_layers, n_head=m.num_heads,
        n_inner=m.intermediate_size, n_positions=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings, initializer_range=m.initializer_range,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        # Dropout off: the numbers must not depend on the dropout RNG of each rank.
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_attention(m),
    )


def _hf_config(m, tokenizer):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(m.name_or_path, revision=m.revision,
                                          trust_remote_code=m.trust_remote_code, **_attention(m))
    except Exception as e:  # noqa: BLE001 - transformers raises many types; the user needs one message
        raise ModelError("model.name_or_path: " + load_message("model config", m.name_or_path, e)) from None


register(ModelSpec("llama", _llama_config, pretrained=False))
register(ModelSpec("gpt2", _gpt2_config, pretrained=False))
register(ModelSpec("hf", _hf_config, pretrained=True))


def load_tokenizer(m):
    """The embedded tokenizer, a tokenizer folder / hub id, or (kind=hf, tokenizer null) the model's own."""
    source = m.tokenizer
    if m.kind == "hf" and (source is None or source == "embedded" and _has_tokenizer(m.name_or_path)):
        source = m.name_or_path
    if source in (None, "embedded"):
        return embedded_tokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source, revision=m.revision if source == m.name_or_path else None,
                                            trust_remote_code=m.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        key = "model.name_or_path" if source == m.name_or_path else "model.tokenizer"
        raise ModelError(f"{key}: " + load_message("tokenizer", source, e)) from None
    if tok.eos_token_id is None:
        raise ModelError(f"the tokenizer from {source!r} has no EOS token; packing needs one "
                         f"(set model.tokenizer to a tokenizer that has one)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # padding positions never carry loss; any id will do
    tok.model_max_length = 1 << 60  # documents are tokenized whole, then packed or truncated to data.seq_len
    return tok


def _has_tokenizer(path) -> bool:
    if not path or not os.path.isdir(path):
        return True  # a hub id: assume it ships one
    return any(os.path.exists(os.path.join(path, f)) for f in
               ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def describe(m, tokenizer) -> ModelInfo:
    """Read (pretrained) or make (preset) the model's config; no weights are touched."""
    try:
        hf_config = get_spec(m.kind).make_config(m, tokenizer)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' config validation: report it as a model problem
        raise ModelError(f"model: the {m.kind} config from model.* is invalid: {one_line(e)}") from None
    if get_spec(m.kind).pretrained:
        _require_causal_decoder(m, hf_config)
    text = text_config(hf_config)

    def first(*names, default=None):
        for n in names:
            v = getattr(text, n, None)
            if v is not None:
                return v
        return default

    heads = first("num_attention_heads", "n_head")
    return ModelInfo(
        hf_config=hf_config,
        max_positions=first("max_position_embeddings", "n_positions", "max_seq_len", default=1 << 30),
        num_layers=first("num_hidden_layers", "n_layer"),
        hidden_size=first("hidden_size", "n_embd"),
        num_heads=heads,
        num_kv_heads=first("num_key_value_heads", default=heads),
        vocab_size=first("vocab_size"),
    )


def _require_causal_decoder(m, hf_config) -> None:
    """Refuse a model that is not a causal decoder (before any process group starts). A causal LM class alone
    is not enough: transformers maps BERT-likes to a `...LMHeadModel`/`...ForCausalLM` that only works as a
    decoder (`is_decoder=True`), and BART-likes to the decoder half of an encoder-decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    model_type = getattr(hf_config, "model_type", None) or type(hf_config).__name__
    why = None
    if getattr(hf_config, "is_encoder_decoder", False):
        why = "but an encoder-decoder"
    elif model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not (
            getattr(hf_config, "is_decoder", False) or getattr(hf_config, "causal", False)):
        why = "but a bidirectional encoder (its config has is_decoder=false)"
    elif causal_lm_class(hf_config) is None and \
            "AutoModelForCausalLM" not in (getattr(hf_config, "auto_map", None) or {}):
        why = "and transformers has no causal LM class for it"
    if why:
        raise ModelError(f"model.name_or_path: {m.name_or_path} holds a {model_type} model, which is not a causal "
                         f"decoder ({why}); Tessera trains causal language models (AutoModelForCausalLM)")


def attention_problems(cfg, info: ModelInfo) -> list:
    """An explicit model.attn_implementation the model or this machine can't run, as one problem (checked on
    the model built on the meta device: transformers' own checks, no weights)."""
    impl = cfg.model.attn_implementation
    if not impl:
        return []
    device = cfg.train.device
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if "flash" in impl and on_cpu:
        return [f"model.attn_implementation={impl} needs a CUDA device but training runs on the CPU "
                f"(train.device={device}); leave model.attn_implementation null (the model's default) or use "
                f"sdpa or eager"]
    if impl == "flex_attention" and on_cpu:  # torch's FlexAttention has no backward on the CPU
        return [f"model.attn_implementation={impl} can't train on the CPU (torch's FlexAttention has no backward "
                f"there; train.device={device}); leave model.attn_implementation null (the model's default) or "
                f"use sdpa or eager"]
    try:
        meta_model(info.hf_config)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError / ImportError with long messages
        first = one_line(e).split(" Please request")[0]  # transformers' advice to file an issue is not for the user
        return [f"model.attn_implementation={impl} can't be used with this model here: {first}"]
    return []


def model_problems(cfg, info: ModelInfo, tokenizer) -> list:
    problems = attention_problems(cfg, info)
    if cfg.data.seq_len > info.max_positions:
        key = "model.max_position_embeddings" if cfg.model.kind != "hf" else "the model's max_position_embeddings"
        problems.append(f"data.seq_len={cfg.data.seq_len} exceeds {key}={info.max_positions}; lower data.seq_len")
    if len(tokenizer) > info.vocab_size:
        problems.append(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                        f"{info.vocab_size}; set model.tokenizer to the model's own tokenizer")
    if cfg.data.packing == "documents":
        if not takes_position_ids(info.hf_config):
            problems.append(f"data.packing=documents needs a model whose forward takes position_ids (restarting at "
                            f"each packed document); {info.hf_config.model_type} does not: use data.packing=eos")
    return problems


def build(m, info: ModelInfo, seed: int | None = None, device: torch.device | str | None = None,
          dtype=torch.float32, load_weights: bool = True, quantization: str = "none", quantize_on=None):
    """Build the model in the caller's construction context (plain, meta device, DeepSpeed's partitioned init).
    Pretrained: weights from `name_or_path`. Presets with `seed`: the seeded initial weights of models/init.py,
    identical whatever the strategy, world size or device; without `seed` whatever construction leaves, for a
    strategy to write the seeded weights into its own layout. `load_weights=False`: a pretrained model's
    architecture only (its weights are then read with `pretrained_weights`). `quantization=nf4` (QLoRA): the
    pretrained linear layers are held in 4 bits by bitsandbytes, quantized as they load onto `quantize_on`. The
    global RNG is left as it was."""
    from transformers import AutoModelForCausalLM

    spec = get_spec(m.kind)
    kwargs = {}
    if m.attn_implementation:
        kwargs["attn_implementation"] = m.attn_implementation
    if quantization == "nf4":
        from transformers import BitsAndBytesConfig

        # the adapters and every unquantized module compute in fp32 (autocast lowers them under bf16 / fp16)
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=torch.float32)
        kwargs["device_map"] = {"": str(quantize_on or "cpu")}
    if spec.pretrained and load_weights:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                m.name_or_path, config=info.hf_config, revision=m.revision, trust_remote_code=m.trust_remote_code,
                dtype=dtype, weights_only=True, **kwargs)  # a .bin file's pickle: tensors only, never code
        except Exception as e:  # noqa: BLE001
            raise ModelError("model.name_or_path: " + load_message("model weights", m.name_or_path, e)) from None
        if quantization == "nf4":
            keep_training_layout(model)
    else:
        cpu_rng = torch.random.get_rng_state()
        try:
            model = AutoModelForCausalLM.from_config(info.hf_config, dtype=dtype, **kwargs)
        finally:
            torch.random.set_rng_state(cpu_rng)
        if seed is not None and not spec.pretrained:
            copy_full_tensors(model, initial_weights(info.hf_config, seed))
        if spec.pretrained:
            adopt_generation_config(model, m)
    return model if device is None else model.to(device)


def adopt_generation_config(model, m) -> None:
    """Give a pretrained model built from its config alone (its weights read by the strategy) the generation config
    from_pretrained would have read: the source's generation_config.json (sampling defaults, stop tokens), or where
    it has none (or an unreadable one), the one transformers then makes from config.json; so every layout exports
    the same file."""
    from transformers import GenerationConfig

    if not model.can_generate():
        return
    for source in ({}, {"config_file_name": "config.json", "_from_model_config": True}):  # transformers' order
        try:
            model.generation_config = GenerationConfig.from_pretrained(m.name_or_path, revision=m.revision,
                                                                       **source)
            return
        except OSError:  # no such file, or not JSON: transformers' own fallback
            continue
        except Exception as e:  # noqa: BLE001 - values transformers refuses: one message, as from_pretrained's
            raise ModelError("model.name_or_path: " + load_message("generation config", m.name_or_path, e)) from None


def keep_training_layout(model) -> None:
    """bitsandbytes repacks a 4-bit weight for its CPU inference kernel the first time the layer runs in eval mode
    without gradients, and the repacked layer computes outside autograd from then on (training after an evaluation
    would stop every gradient at it; its kernel also needs sizes in multiples of 32): keep the training layout."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):  # bitsandbytes.nn.Linear4bit
            module.support_avx512bf16_for_cpu = False


def pretrained_weights(m, model):
    """The pretrained checkpoint of `m`, to read tensor by tensor (models/weights.py)."""
    return PretrainedWeights(m, getattr(model, "base_model_prefix", ""))


def count_parameters(model) -> int:
    """All parameters, also when each rank holds only a partition (DeepSpeed's ds_numel is the full size)."""
    return sum(math.prod(full_shape(p)) for p in model.parameters())
