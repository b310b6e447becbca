"""models/weights.py: a pretrained checkpoint read tensor by tensor, or rows of one, from every layout that
save_pretrained writes (single / sharded safetensors, pytorch_model.bin / its index), with or without the
model's base_model_prefix."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from models.weights import PretrainedWeights
from trainer.errors import ModelError


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


MODELS = {"llama": _llama, "gpt2": _gpt2}
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
