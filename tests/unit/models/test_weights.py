"""models/weights.py: a pretrained checkpoint read tensor by tensor, or rows of one, from every layout that
save_pretrained writes (single / sharded safetensors, pytorch_model.bin / its index), with or without the
model's base_model_prefix; and with transformers' own loading rules (renamed keys, per-expert tensors fused into
the model's 3-D expert parameters, tied weights), checked against what from_pretrained loads."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from models.weights import PretrainedWeights
from tessera.errors import ModelError


def _llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return GPT2LMHeadModel(cfg).eval()


def _apertus():
    """Apertus' xIELU activation has 0-dim buffers in the checkpoint (beta, eps): read whole, never sliced."""
    from transformers import ApertusConfig, ApertusForCausalLM

    torch.manual_seed(0)
    cfg = ApertusConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = ApertusForCausalLM(cfg).eval()
    assert any(t.dim() == 0 for t in model.state_dict().values())
    return model


MODELS = {"llama": _llama, "gpt2": _gpt2, "apertus": _apertus}
# layout -> (save_pretrained kwargs, or None: torch.save as transformers 4 did; files that must be there)
LAYOUTS = {
    "safetensors": ({}, ["model.safetensors"]),
    "sharded-safetensors": ({"max_shard_size": "20KB"}, ["model.safetensors.index.json"]),
    "bin": (None, ["pytorch_model.bin"]),
    "sharded-bin": (None, ["pytorch_model.bin.index.json"]),
}


def _save_bin(model, folder, sharded: bool):
    """pytorch_model.bin (or pytorch_model-0000k-of-0000n.bin + pytorch_model.bin.index.json), as
    save_pretrained(safe_serialization=False) wrote them before transformers 5 dropped it: tied copies left
    out, each shard a torch.save'd state dict."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    params = dict(model.named_parameters())  # tied weights once
    state = {k: v.detach().clone() for k, v in model.state_dict().items()
             if k in params or k not in dict(model.named_parameters(remove_duplicate=False))}
    if not sharded:
        torch.save(state, folder / "pytorch_model.bin")
        return
    keys = list(state)
    groups = [keys[i::3] for i in range(3)]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"pytorch_model-{i + 1:05d}-of-{len(groups):05d}.bin"
        torch.save({k: state[k] for k in group}, folder / fname)
        weight_map.update({k: fname for k in group})
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _m(path):
    return SimpleNamespace(name_or_path=str(path), revision=None)


def _save(model, folder, layout):
    kwargs, expected = LAYOUTS[layout]
    if kwargs is not None:
        model.save_pretrained(folder, **kwargs)
    else:
        _save_bin(model, folder, sharded=layout.startswith("sharded"))
    for name in expected:
        assert (folder / name).exists(), sorted(p.name for p in folder.iterdir())
    if layout.startswith("sharded"):
        index = json.loads((folder / expected[0]).read_text())
        assert len(set(index["weight_map"].values())) > 1  # really more than one file


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(MODELS))
def test_reads_every_parameter_and_rows(tmp_path, kind, layout):
    model = MODELS[kind]()
    _save(model, tmp_path, layout)
    weights = PretrainedWeights(_m(tmp_path), model.base_model_prefix)
    params = dict(model.named_parameters())  # tied lm_head (gpt2) appears once, under transformer.wte
    assert weights.missing(params) == []
    for name, p in params.items():
        assert weights.key(name) is not None, name
        assert weights.shape(name) == list(p.shape), name
        full = weights.read(name)
        assert full.dtype == p.dtype and torch.equal(full, p.detach()), name
        if p.dim():
            n = p.shape[0]
            for rows in (slice(0, 1), slice(n // 3, n // 3 + 2), slice(n - 1, n), slice(0, n)):
                assert torch.equal(weights.read(name, rows), p.detach()[rows]), (name, rows)
        if p.dim() == 2:  # a block: a slice per dimension (tensor-parallel shards of columns, say)
            block = (slice(1, 3), slice(p.shape[1] // 2, p.shape[1]))
            assert torch.equal(weights.read(name, block), p.detach()[block]), name
    # the persistent buffers of the state dict are there too
    for name, tensor in model.state_dict().items():
        if weights.key(name) is not None:
            assert torch.equal(weights.read(name), tensor), name
    weights.close()


def test_rows_of_a_sliced_read_are_a_copy_for_bin(tmp_path):
    """Writing into what read() returned must not alter the checkpoint (a .bin is memory-mapped)."""
    model = _llama()
    _save(model, tmp_path, "bin")
    weights = PretrainedWeights(_m(tmp_path), model.base_model_prefix)
    name = "model.embed_tokens.weight"
    part = weights.read(name, slice(0, 2))
    part.zero_()
    assert torch.equal(weights.read(name, slice(0, 2)), model.model.embed_tokens.weight.detach()[:2])


def test_prefixless_gpt2_keys_are_matched(tmp_path):
    """GPT-2 hub checkpoints store the base model's keys (`h.0.attn...`, `wte.weight`) for the LM's
    `transformer.h.0.attn...`."""
    model = _gpt2()
    prefix = model.base_model_prefix
    assert prefix == "transformer"
    base = {k[len(prefix) + 1:]: v.contiguous() for k, v in model.state_dict().items()
            if k.startswith(prefix + ".")}
    assert "h.0.attn.c_attn.weight" in base and "wte.weight" in base
    save_file(base, str(tmp_path / "model.safetensors"))
    weights = PretrainedWeights(_m(tmp_path), prefix)
    params = dict(model.named_parameters())
    assert weights.missing(params) == []
    assert weights.key("transformer.h.0.attn.c_attn.weight") == "h.0.attn.c_attn.weight"
    for name, p in params.items():
        assert torch.equal(weights.read(name), p.detach()), name
        assert torch.equal(weights.read(name, slice(1, 3)), p.detach()[1:3]), name
    # and the other way round: a checkpoint key with the prefix, asked without it
    save_file({"transformer.wte.weight": model.transformer.wte.weight.detach().contiguous()},
              str(tmp_path / "model.safetensors"))
    weights = PretrainedWeights(_m(tmp_path), prefix)
    assert weights.key("wte.weight") == "transformer.wte.weight"
    assert weights.key("transformer.wte.weight") == "transformer.wte.weight"


def test_missing_lists_absent_names(tmp_path):
    model = _llama()
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if k not in ("lm_head.weight", "model.layers.1.mlp.up_proj.weight")}
    save_file(state, str(tmp_path / "model.safetensors"))
    weights = PretrainedWeights(_m(tmp_path), model.base_model_prefix)
    names = [n for n, _ in model.named_parameters()] + ["model.no_such.weight"]
    assert weights.missing(names) == ["model.layers.1.mlp.up_proj.weight", "lm_head.weight", "model.no_such.weight"]
    assert weights.missing(iter(["model.norm.weight"])) == []  # a generator, as the FSDP strategy passes


def test_folder_without_weights_is_a_model_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError) as info:
        PretrainedWeights(_m(tmp_path), "model")
    msg = str(info.value)
    assert "model.name_or_path" in msg and str(tmp_path) in msg
    assert "model.safetensors" in msg and "pytorch_model.bin" in msg


def test_missing_folder_is_a_model_error(tmp_path):
    with pytest.raises(ModelError) as info:
        PretrainedWeights(_m(tmp_path / "no-such-model"), "model")
    assert "model.name_or_path" in str(info.value) and "no such folder" in str(info.value)


def test_unreadable_checkpoint_file_is_a_model_error(tmp_path):
    """A truncated safetensors file, or an index naming a shard that is not there, is one clear ModelError
    (not a SafetensorError / FileNotFoundError traceback from inside the strategy's setup)."""
    (tmp_path / "model.safetensors").write_text("junk")
    with pytest.raises(ModelError) as info:
        PretrainedWeights(_m(tmp_path), "model")
    assert "model.name_or_path" in str(info.value) and "model.safetensors" in str(info.value)

    sharded = tmp_path / "sharded"
    _save(_llama(), sharded, "sharded-safetensors")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    lost = max(index["weight_map"].values())
    (sharded / lost).unlink()
    weights = PretrainedWeights(_m(sharded), "model")  # the index alone is read at first
    name = next(k for k, f in index["weight_map"].items() if f == lost)
    with pytest.raises(ModelError) as info:
        weights.read(name)
    assert "model.name_or_path" in str(info.value) and lost in str(info.value)


# ---- transformers' own key renaming, expert fusing and weight tying (models/checkpoint_keys.py) ---------------
# Each tiny model is saved, then every tensor read here must be exactly what from_pretrained puts in the model.

def _neox():
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False)


def _mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=64)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=300, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)


def _gpt2_tied():
    return GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0)


def _llama_tied():
    return LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=True)


def _llama_untied():
    cfg = _llama_tied()
    cfg.tie_word_embeddings = False
    return cfg


CONFIGS = {"gpt_neox": _neox, "mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "gpt2": _gpt2_tied,
           "llama": _llama_untied, "llama-tied": _llama_tied}


def _hf_model(make_config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config()).eval()


def _reference(folder):
    """What from_pretrained puts in each tensor of the model: the truth the reads are checked against."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def _hf_m(path):
    return SimpleNamespace(name_or_path=str(path), revision=None, trust_remote_code=False)


def _blocks(shape):
    """Blocks a sharding strategy asks for: rows, rows x columns, and for 3-D expert tensors experts x rows x
    columns (rows across the gate/up seam of a fused gate_up_proj)."""
    if len(shape) == 1:
        return [slice(1, 3), (slice(shape[0] // 2, shape[0]),)]
    if len(shape) == 2:
        return [slice(1, 3), (slice(1, 3), slice(shape[1] // 2, shape[1]))]
    e, r, c = shape
    return [(slice(1, 3), slice(None)), (slice(1, 3),), (slice(0, e), slice(r // 2 - 2, r // 2 + 3)),
            (slice(e - 1, e), slice(1, r, 1), slice(c // 2, c)), (slice(0, e, 2), slice(0, r), slice(0, c))]


def _check_reads_like_from_pretrained(model, folder):
    ref = _reference(folder)
    weights = PretrainedWeights(_hf_m(folder), model.base_model_prefix)
    names = [n for n, _ in model.named_parameters()]
    assert set(names) <= set(ref)
    assert weights.missing(names) == [] and weights.missing(ref) == []
    for name, want in ref.items():
        assert torch.equal(want, model.state_dict()[name]), name  # the save/load round trip itself is exact
        assert weights.key(name) is not None, name
        assert weights.shape(name) == list(want.shape), name
        got = weights.read(name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
        for block in _blocks(list(want.shape)):
            assert torch.equal(weights.read(name, block), want[block]), (name, block)
    weights.close()
    return weights


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_reads_what_from_pretrained_loads(tmp_path, kind):
    """save_pretrained writes transformers' checkpoint layout (per-expert tensors, `embed_out`, tied weights left
    out); every tensor, and blocks of it, reads as from_pretrained loads it."""
    model = _hf_model(CONFIGS[kind])
    model.save_pretrained(tmp_path)
    _check_reads_like_from_pretrained(model, tmp_path)


def _load_state(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _file_keys(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        return set(fh.keys())


def test_checkpoint_key_names_per_architecture(tmp_path):
    """The renamed and fused keys: GPT-NeoX's `embed_out.weight` is `lm_head.weight`; Mixtral's
    `block_sparse_moe.experts.{i}.w1/w3.weight` make `mlp.experts.gate_up_proj` and `w2` makes
    `mlp.experts.down_proj`; Qwen3-MoE's `mlp.experts.{i}.gate_proj/up_proj/down_proj.weight` likewise; a tied
    `lm_head.weight` the checkpoint lacks is the input embedding."""
    folders = {}
    for kind in ("gpt_neox", "mixtral", "qwen3_moe", "gpt2"):
        folders[kind] = tmp_path / kind
        _hf_model(CONFIGS[kind]).save_pretrained(folders[kind])
    w = {kind: PretrainedWeights(_hf_m(f), "") for kind, f in folders.items()}

    assert "embed_out.weight" in _file_keys(folders["gpt_neox"])
    assert w["gpt_neox"].key("lm_head.weight") == "embed_out.weight"

    keys = _file_keys(folders["mixtral"])
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)  # save_pretrained writes the per-expert layout
    prefix = "model.layers.1.block_sparse_moe.experts"
    assert w["mixtral"].sources("model.layers.1.mlp.experts.gate_up_proj") == \
        [f"{prefix}.{i}.w1.weight" for i in range(4)] + [f"{prefix}.{i}.w3.weight" for i in range(4)]
    assert w["mixtral"].sources("model.layers.1.mlp.experts.down_proj") == [f"{prefix}.{i}.w2.weight" for i in range(4)]
    assert w["mixtral"].key("model.layers.1.mlp.gate.weight") == "model.layers.1.block_sparse_moe.gate.weight"
    assert w["mixtral"].shape("model.layers.1.mlp.experts.gate_up_proj") == [4, 2 * 48, 32]
    assert w["mixtral"].shape("model.layers.1.mlp.experts.down_proj") == [4, 32, 48]

    prefix = "model.layers.0.mlp.experts"
    assert w["qwen3_moe"].sources("model.layers.0.mlp.experts.gate_up_proj") == \
        [f"{prefix}.{i}.gate_proj.weight" for i in range(4)] + [f"{prefix}.{i}.up_proj.weight" for i in range(4)]
    assert w["qwen3_moe"].sources("model.layers.0.mlp.experts.down_proj") == \
        [f"{prefix}.{i}.down_proj.weight" for i in range(4)]
    assert w["qwen3_moe"].shape("model.layers.0.mlp.experts.gate_up_proj") == [4, 2 * 24, 32]

    assert "lm_head.weight" not in _file_keys(folders["gpt2"])
    assert w["gpt2"].key("lm_head.weight") == "transformer.wte.weight"
    assert w["gpt2"].missing(["lm_head.weight", "transformer.wte.weight", "transformer.no_such"]) == \
        ["transformer.no_such"]


def test_a_block_of_fused_experts_reads_only_its_experts(tmp_path, monkeypatch):
    """Rank-local reads: a block of `gate_up_proj` reads its experts' gate and up tensors, only the rows of each
    that the block reaches (none of the up tensors for rows of the gate half)."""
    model = _hf_model(_mixtral)
    model.save_pretrained(tmp_path)
    weights = PretrainedWeights(_hf_m(tmp_path), "model")
    want = _reference(tmp_path)["model.layers.0.mlp.experts.gate_up_proj"]
    reads = []
    real = PretrainedWeights._read_key

    def spy(self, key, index=None):
        out = real(self, key, index)
        reads.append((key, out.numel()))
        return out

    monkeypatch.setattr(PretrainedWeights, "_read_key", spy)
    block = (slice(1, 3), slice(10, 20), slice(8, 24))  # experts 1-2, rows of the gate half only
    assert torch.equal(weights.read("model.layers.0.mlp.experts.gate_up_proj", block), want[block])
    prefix = "model.layers.0.block_sparse_moe.experts"
    assert sorted(k for k, n in reads if n) == [f"{prefix}.{i}.w1.weight" for i in (1, 2)]
    assert sum(n for _, n in reads) == 2 * 10 * 16  # the block's bytes, no more
    assert all(f"experts.{i}." not in k for k, _ in reads for i in (0, 3))

    reads.clear()
    block = (slice(3, 4), slice(40, 60))  # expert 3, rows across the gate/up seam (intermediate size 48)
    assert torch.equal(weights.read("model.layers.0.mlp.experts.gate_up_proj", block), want[block])
    assert sorted(k for k, _ in reads) == [f"{prefix}.3.w1.weight", f"{prefix}.3.w3.weight"]
    assert sum(n for _, n in reads) == 20 * 32


def _save_fused(model, folder):
    """The layout of a checkpoint that already holds the model's own names (fused 3-D experts, `lm_head`): what
    `model.state_dict()` is, tied copies left out."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    params = dict(model.named_parameters())
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
             if k in params or k not in dict(model.named_parameters(remove_duplicate=False))}
    save_file(state, str(folder / "model.safetensors"))
    return state


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_neox", "gpt2"])
def test_checkpoint_in_the_models_own_layout(tmp_path, kind):
    """A checkpoint stored under the model's names (fused experts, `lm_head.weight` for GPT-NeoX) loads as it
    is, in from_pretrained and here."""
    model = _hf_model(CONFIGS[kind])
    state = _save_fused(model, tmp_path)
    if kind in ("mixtral", "qwen3_moe"):
        assert "model.layers.0.mlp.experts.gate_up_proj" in state
    weights = _check_reads_like_from_pretrained(model, tmp_path)
    if kind in ("mixtral", "qwen3_moe"):
        assert weights.key("model.layers.0.mlp.experts.gate_up_proj") == "model.layers.0.mlp.experts.gate_up_proj"


def test_sharded_and_bin_per_expert_checkpoints(tmp_path):
    """Per-expert tensors spread over several safetensors shards, and in a pytorch_model.bin."""
    model = _hf_model(_mixtral)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    _check_reads_like_from_pretrained(model, sharded)

    binary = tmp_path / "bin"
    model.save_pretrained(binary)
    torch.save(_load_state(binary), binary / "pytorch_model.bin")
    (binary / "model.safetensors").unlink()
    _check_reads_like_from_pretrained(model, binary)


def test_legacy_key_spellings(tmp_path):
    """transformers' `legacy` renamings (`LayerNorm.gamma` / `LayerNorm.beta`), on a BERT decoder as a causal LM,
    and a GPT-2 checkpoint of the base model (no `transformer.` prefix) with its config."""
    from transformers import BertConfig

    model = _hf_model(lambda: BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=64, is_decoder=True))
    model.save_pretrained(tmp_path / "bert")
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in _load_state(tmp_path / "bert").items()}
    assert "bert.embeddings.LayerNorm.gamma" in state
    save_file(state, str(tmp_path / "bert" / "model.safetensors"))
    weights = _check_reads_like_from_pretrained(model, tmp_path / "bert")
    assert weights.key("bert.embeddings.LayerNorm.weight") == "bert.embeddings.LayerNorm.gamma"

    model = _hf_model(_gpt2_tied)
    model.save_pretrained(tmp_path / "gpt2")
    state = {k.removeprefix("transformer."): v for k, v in _load_state(tmp_path / "gpt2").items()}
    save_file(state, str(tmp_path / "gpt2" / "model.safetensors"))
    weights = _check_reads_like_from_pretrained(model, tmp_path / "gpt2")
    assert weights.key("lm_head.weight") == "wte.weight"


def test_tied_source_missing_takes_the_target(tmp_path):
    """from_pretrained ties symmetrically: a checkpoint with `lm_head.weight` but no input embedding gives the
    embedding the lm_head's values."""
    model = _hf_model(_llama_tied)
    model.save_pretrained(tmp_path)
    state = _load_state(tmp_path)
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    ref = _reference(tmp_path)
    weights = PretrainedWeights(_hf_m(tmp_path), "model")
    assert weights.missing(ref) == []
    assert weights.key("model.embed_tokens.weight") == "lm_head.weight"
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(weights.read(name), ref[name])
        assert torch.equal(weights.read(name, slice(5, 9)), ref[name][5:9])


def test_untied_checkpoint_lacking_lm_head_is_missing(tmp_path):
    model = _hf_model(_llama_untied)
    model.save_pretrained(tmp_path)
    state = _load_state(tmp_path)
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    weights = PretrainedWeights(_hf_m(tmp_path), "model")
    assert weights.missing(["lm_head.weight", "model.embed_tokens.weight"]) == ["lm_head.weight"]
    assert weights.key("lm_head.weight") is None


# Other operations transformers declares, each handled by the converter's own code here: a fused tensor split in
# several (Chunk: HRM's `attn.gqkv_proj`; Split by the model's sizes: Lara's `linear_attn.in_proj`), and a plain
# concatenation (OLMo-hybrid's q/k/v conv1d into `linear_attn.conv1d`, read block-wise). Skipped where the
# installed transformers lacks the model.
DECLARED = {
    "hrm_text": ("model.H_module.layers.0.self_attn.k_proj.weight", "model.H_module.layers.0.attn.gqkv_proj.weight"),
    "lara_mini": ("model.layers.0.linear_attn.in_proj_z.weight", "model.layers.0.linear_attn.in_proj.weight"),
    "olmo_hybrid": ("model.layers.0.linear_attn.conv1d.weight", "model.layers.0.linear_attn.q_conv1d.weight"),
}


@pytest.mark.parametrize("model_type", list(DECLARED))
def test_other_declared_conversions(tmp_path, model_type):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {model_type}")
    cfg = AutoConfig.for_model(model_type, vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                               pad_token_id=0, bos_token_id=1, eos_token_id=1)
    model = _hf_model(lambda: cfg)
    model.save_pretrained(tmp_path)
    name, first_key = DECLARED[model_type]
    assert first_key in _file_keys(tmp_path) and name not in _file_keys(tmp_path)
    weights = _check_reads_like_from_pretrained(model, tmp_path)
    assert weights.key(name) == first_key


def test_non_persistent_buffers_are_never_read(tmp_path):
    """A checkpoint may hold a tensor the model keeps as a non-persistent buffer (old checkpoints stored rotary
    `inv_freq`); from_pretrained ignores it, so it is not read here either."""
    model = _hf_model(_llama_untied)
    model.save_pretrained(tmp_path)
    state = _load_state(tmp_path)
    name = "model.rotary_emb.inv_freq"
    assert name in dict(model.named_buffers()) and name not in model.state_dict()
    state[name] = torch.zeros_like(dict(model.named_buffers())[name])
    save_file(state, str(tmp_path / "model.safetensors"))
    weights = PretrainedWeights(_hf_m(tmp_path), "model")
    assert weights.key(name) is None and weights.missing([name]) == [name]
    assert weights.key("model.norm.weight") == "model.norm.weight"


def test_a_config_transformers_cannot_build_reads_keys_as_they_are(tmp_path, caplog):
    """Without a model transformers knows (a config of an unknown model type), names are checkpoint keys, with or
    without the base_model_prefix, as before; a warning says so."""
    model = _llama()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model_type"}))
    weights = PretrainedWeights(_m(tmp_path), model.base_model_prefix)
    with caplog.at_level("WARNING", logger="models.weights"):
        assert weights.missing(dict(model.named_parameters())) == []
    assert "key mapping is not available" in caplog.text
    for name, p in model.named_parameters():
        assert torch.equal(weights.read(name, slice(0, 2)), p.detach()[:2]), name
    assert weights.key("embed_tokens.weight") == "model.embed_tokens.weight"
