"""Seeded initial weights that do not depend on how (or where) the model is built.

A preset's initial weights come from a meta-device copy of the model, one *init unit* at a time: each decoder
block (an item of the model's list of blocks, `decoder_blocks`) is a unit, and everything outside the blocks
(embeddings, final norm, head, rotary tables) is one more. A unit is materialized on CPU in fp32, the global
RNG is seeded from (seed, unit name), and Hugging Face's own `initialize_weights` runs children first, as
`from_config` would, over a fresh meta copy of the model in which only that unit is real. The values therefore
depend only on the seed and the unit, never on construction order, world size, partitioning or device, and no
more than one unit is ever materialized at a time: strategies that shard (ZeRO-3, FSDP) write each unit into
their shards and drop it.
"""
from __future__ import annotations

import copy
import zlib
from typing import Dict, Iterator, List, Tuple

import torch
from torch import nn

from models.loading import causal_lm_class


def text_config(config):
    """The language model's config: a multimodal config's text part (`get_text_config`), else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def decoder_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(qualified name, module) of the model's repeated blocks: the items of the nn.ModuleList that holds the
    most parameter tensors (the outermost one on a tie). Found from the module tree alone, so it holds for any
    causal LM whose blocks sit in one list (`layers`, `h`, `blocks`), hybrids with several block classes
    included; a list nested inside a block (MoE experts) always holds fewer tensors than the list of blocks.
    Tensors are counted, not elements: on the meta device and in ZeRO-3's partitions only the count is real."""
    best, best_size = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module):
            size = sum(1 for _ in module.parameters())
            if size > best_size:
                best, best_size = (name, module), size
    if best is None:
        return []
    prefix = best[0] + "." if best[0] else ""
    return [(prefix + child_name, child) for child_name, child in best[1].named_children()]


def base_model_path(model: nn.Module) -> str:
    """Where the base model (the module whose forward runs the blocks) sits in the causal LM: its
    `base_model_prefix` attribute (`model`, `transformer`), or else the module that holds the list of blocks (Llama
    4's causal LM says `language_model` and holds `model`); "" for a model that is its own base."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    blocks = decoder_blocks(model)
    return blocks[0][0].rpartition(".")[0].rpartition(".")[0] if blocks else ""


def meta_model(hf_config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The causal LM on the meta device (shapes only, no memory, no init). Its class is constructed directly:
    `from_config` would build under DeepSpeed's partitioned init while a ZeRO-3 config is active. In fp32, or
    as Hugging Face builds a model in another `dtype` (`from_pretrained(dtype=...)`): what it creates in the
    default dtype in `dtype`, what it computes in fp32 explicitly (rotary `inv_freq`) in fp32."""
    from transformers import AutoModelForCausalLM

    model_class = causal_lm_class(hf_config)
    with torch.device("meta"):
        if model_class is None:  # remote code (its config was only read with model.trust_remote_code=true)
            return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=True)
        if dtype == torch.float32:
            return model_class(hf_config).float()
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return model_class(hf_config)
        finally:
            torch.set_default_dtype(before)


def buffers_in_model_dtype(hf_config) -> List[str]:
    """Qualified names of the buffers that follow the model's dtype: floating-point buffers Hugging Face builds in
    the default dtype, so that a model loaded in bf16 holds them in bf16 (XGLM's sinusoidal positions, MiniMax's
    decay tables), not those it computes in fp32 whatever the dtype (rotary `inv_freq`, DeepSeek-V3's
    `e_score_correction_bias`). 0-dim buffers are left out: a 0-dim tensor never promotes the bf16 tensor it
    meets (Gemma's `embed_scale`, Apertus' xIELU `beta`), so their fp32 values stay as trained and exported."""
    probe = torch.bfloat16
    return [name for name, b in meta_model(hf_config, probe).named_buffers() if b.dtype == probe and b.dim() > 0]


@torch.no_grad()
def initial_weights(hf_config, seed: int) -> Iterator[Dict[str, torch.Tensor]]:
    """Per init unit, {qualified name: full fp32 CPU tensor} for every parameter and every buffer that the
    model's initialization sets. Tied parameters appear once, under their first name (as `named_parameters`)."""
    pristine = meta_model(hf_config)
    block_names = [name for name, _ in decoder_blocks(pristine)]
    seen = set()
    for unit_name in [*block_names, ""]:  # "": everything outside the blocks
        # A fresh copy per unit: transformers' initialize_weights marks what it initialized and skips it after.
        model = copy.deepcopy(pristine)
        names = {id(t): n for n, t in model.named_buffers()}
        names.update({id(t): n for n, t in model.named_parameters()})  # tied: the first name, as named_parameters
        originals, fresh = [], {}
        for module in _unit_modules(model, unit_name, block_names):
            for is_param, own in ((True, module.named_parameters(recurse=False, remove_duplicate=False)),
                                  (False, module.named_buffers(recurse=False, remove_duplicate=False))):
                for key, t in list(own):
                    if id(t) not in fresh:
                        value = torch.full(t.shape, float("nan"), dtype=torch.float32)
                        fresh[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if is_param else value
                    originals.append((module, is_param, key, t))
                    setattr(module, key, fresh[id(t)])
        rng = torch.random.get_rng_state()
        torch.manual_seed(zlib.crc32(f"{seed}:{unit_name or '<root>'}".encode()))
        try:
            # Hugging Face's own initialization, over the whole model children first (as from_config): on the
            # meta device it draws no random numbers, so the unit's values depend on the seed and the unit only.
            model.initialize_weights()
        finally:
            torch.random.set_rng_state(rng)
        values = {}
        for module, is_param, key, t in originals:
            name, new = names[id(t)], getattr(module, key)
            if name in seen:
                continue
            seen.add(name)
            if torch.isnan(new).any():
                if is_param:
                    raise RuntimeError(f"{type(model).__name__}.initialize_weights left {key!r} of "
                                       f"{type(module).__name__} unset; this model cannot be initialized by units")
                continue  # a buffer the initialization does not set: the one built in __init__ stays
            values[name] = new.detach()
        yield values


def _unit_modules(model: nn.Module, unit_name: str, block_names: List[str]) -> List[nn.Module]:
    """The modules of one init unit: a block's subtree, or ("") the model minus every block's subtree."""
    if unit_name:
        return list(model.get_submodule(unit_name).modules())
    blocks = {id(model.get_submodule(n)) for n in block_names}
    out = []

    def visit(module):
        if id(module) not in blocks:
            out.append(module)
            for child in module.children():
                visit(child)

    visit(model)
    return out


def shared_parameters(model: nn.Module) -> list:
    """[[(module, name), ...]] for each parameter held by more than one module (tied embeddings): what a
    parallelizing step that gives each module a new parameter object must tie again (`retie`)."""
    holders = {}
    for module in model.modules():
        for key, p in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(p), []).append((module, key))
    return [h for h in holders.values() if len(h) > 1]


def retie(ties: list) -> None:
    """Make every holder recorded by `shared_parameters` hold its first holder's parameter again."""
    for holders in ties:
        first_module, first_key = holders[0]
        for module, key in holders[1:]:
            setattr(module, key, getattr(first_module, first_key))


def named_tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Parameters (tied ones under their first name) and buffers, by qualified name."""
    targets = dict(model.named_buffers())
    targets.update(model.named_parameters())
    return targets


@torch.no_grad()
def copy_full_tensors(model: nn.Module, units) -> None:
    """Write `initial_weights` units into a model held whole."""
    targets = named_tensors(model)
    for values in units:
        for name, value in values.items():
            targets[name].copy_(value)
