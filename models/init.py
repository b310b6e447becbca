"""Seeded initial weights that do not depend on how (or where) the model is built.

A preset's initial weights come from a meta-device copy of the model, one *init unit* at a time: each decoder
block (an item of the model's list of blocks, `decoder_blocks`) is a unit, and everything outside the blocks
(embeddings, final norm, head, rotary tables) is one more. A unit is materialized on CPU in fp32, the global
RNG is seeded from (seed, unit name), and Hugging Face's own `_init_weights` runs over it children first, as
`from_config` would. The values therefore depend only on the seed and the unit, never on construction order,
world size, partitioning or device, and no more than one unit is ever materialized at a time: strategies that
shard (ZeRO-3, FSDP) write each unit into their shards and drop it.
"""
from __future__ import annotations

import zlib
from typing import Dict, Iterator, List, Tuple

import torch
from torch import nn


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


def _modules_of_unit(root: nn.Module, prefix: str, skip: set) -> List[Tuple[str, nn.Module]]:
    """(qualified name, module) of `root`'s subtree in post-order (children first), minus subtrees in `skip`."""
    out = []

    def visit(name, module):
        for child_name, child in module.named_children():
            if id(child) not in skip:
                visit(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, module))

    visit(prefix, root)
    return out


def _init_fn(model: nn.Module):
    from transformers import PreTrainedModel

    # Composite models: the innermost PreTrainedModel owning a module initializes it (like transformers'
    # smart_apply); for the causal LMs here that is the model itself.
    owners = {id(m): m for m in model.modules() if isinstance(m, PreTrainedModel)}

    def fn(name: str, module: nn.Module):
        owner = model
        parts = name.split(".") if name else []
        for i in range(len(parts), -1, -1):
            candidate = model.get_submodule(".".join(parts[:i])) if i else model
            if id(candidate) in owners:
                owner = candidate
                break
        # transformers' per-module init has no public form (initialize_weights runs over the whole model once,
        # guarded by flags it sets); the private method is called here only.
        owner._init_weights(module)

    return fn


def meta_model(hf_config) -> nn.Module:
    """The causal LM on the meta device (shapes only, no memory, no init). Its class is constructed directly:
    `from_config` would build under DeepSpeed's partitioned init while a ZeRO-3 config is active."""
    from transformers import AutoModelForCausalLM

    from models.registry import causal_lm_class

    model_class = causal_lm_class(hf_config)
    with torch.device("meta"):
        if model_class is None:  # remote code: only from_config knows the class
            return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        return model_class(hf_config).float()


@torch.no_grad()
def initial_weights(hf_config, seed: int) -> Iterator[Dict[str, torch.Tensor]]:
    """Per init unit, {qualified name: full fp32 CPU tensor} for every parameter and every buffer that
    `_init_weights` sets. Tied parameters appear once, under their first name (as `named_parameters`)."""
    model = meta_model(hf_config)
    init = _init_fn(model)
    roots = decoder_blocks(model)
    units = [(name, _modules_of_unit(module, name, set())) for name, module in roots]
    block_ids = {id(m) for _, m in roots}
    units.append(("", _modules_of_unit(model, "", block_ids)))  # everything outside the blocks
    names = {id(t): n for n, t in model.named_buffers()}
    names.update({id(t): n for n, t in model.named_parameters()})  # tied: the first name, as named_parameters
    seen = set()
    for unit_name, modules in units:
        originals, fresh = [], {}
        for mod_name, module in modules:
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
            for mod_name, module in modules:
                init(mod_name, module)
        finally:
            torch.random.set_rng_state(rng)
        values = {}
        for module, is_param, key, t in originals:
            new = getattr(module, key)
            if id(t) in seen:
                continue
            seen.add(id(t))
            if torch.isnan(new).any():
                if is_param:
                    raise RuntimeError(f"{type(model).__name__}._init_weights left {key!r} of "
                                       f"{type(module).__name__} unset; this model cannot be initialized by units")
                continue  # a buffer _init_weights does not set: the one built in __init__ stays
            values[names[id(t)]] = new.detach()
        for module, is_param, key, t in originals:
            setattr(module, key, t)  # back to meta: one unit in memory at a time
        yield values



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
