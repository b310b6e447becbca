"""`--shrink`: a debug-size model of the same architecture, for a model that does not fit this machine (or a quick
check): fewer and narrower layers, heads and key/value heads still dividing each other (4 and 2, as the integration
tests' SMALL model). A preset is shrunk with overrides; a Hugging Face model (model=hf) gets a shrunk copy of its
config saved into the parity folder, with random weights (the folder's weights would not fit the smaller shapes)."""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

from tessera.errors import ModelError, one_line

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 128


def preset_overrides(kind: str) -> List[str]:
    kv = "null" if kind == "gpt2" else KV_HEADS  # gpt2 has no grouped-query attention (models/registry.py)
    return [f"model.hidden_size={HIDDEN}", f"model.num_layers={LAYERS}", f"model.num_heads={HEADS}",
            f"model.num_kv_heads={kv}", f"model.intermediate_size={INTERMEDIATE}"]


def shrink_hf_config(config) -> None:
    """The transformers config shrunk in place. Names through the config's attribute_map (GPT-2's n_layer is
    num_hidden_layers); per-layer lists (layer_types) cut to the new depth."""
    config.num_hidden_layers = LAYERS
    config.hidden_size = HIDDEN
    config.num_attention_heads = HEADS
    if getattr(config, "num_key_value_heads", None) is not None:
        config.num_key_value_heads = KV_HEADS
    if getattr(config, "head_dim", None) is not None:
        config.head_dim = HIDDEN // HEADS
    for key in ("intermediate_size", "n_inner"):
        if getattr(config, key, None) is not None:
            setattr(config, key, INTERMEDIATE)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:LAYERS]


def shrink_hf(model: dict, folder: str, seed: int) -> Tuple[List[str], str]:
    """A shrunk, randomly initialised copy of model.name_or_path saved in `folder` (save_pretrained): the overrides
    that load it on both sides (the original's tokenizer), and a note for the report."""
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed  # start-up time: only for model=hf

    source = model.get("name_or_path")
    try:
        config = AutoConfig.from_pretrained(source, revision=model.get("revision"),
                                            trust_remote_code=bool(model.get("trust_remote_code")))
        shrink_hf_config(config)
        set_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"--shrink: cannot build a debug-size copy of model.name_or_path={source}: {one_line(e)}; "
                         f"run without --shrink") from None
    tokenizer = model.get("tokenizer") or source
    note = (f"model shrunk to a debug size: {source}'s architecture with {LAYERS} layers, hidden {HIDDEN}, "
            f"{HEADS} heads, random init (train.seed={seed}), saved in {folder}")
    return [f"model.name_or_path={folder}", f"model.tokenizer={tokenizer}", "model.revision=null"], note


def shrink(cfg: dict, out_dir: str) -> Tuple[List[str], Optional[str]]:
    """The overrides that shrink side A's model (both sides take them), and the report's note about it."""
    model = cfg["model"]
    if model.get("kind") == "hf":
        return shrink_hf(model, os.path.join(out_dir, "shrunk-model"), int(cfg["train"]["seed"]))
    note = (f"model shrunk to a debug size: model.kind={model.get('kind')} with {LAYERS} layers, hidden {HIDDEN}, "
            f"{HEADS} heads, {KV_HEADS} key/value heads, MLP {INTERMEDIATE}")
    return preset_overrides(str(model.get("kind"))), note
