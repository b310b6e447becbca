"""What the model modules share, as a leaf (it imports nothing from models/, so registry, init, packing and weights
all import it at their top): the transformers class of a config, and the one message for a model, tokenizer or
weights load that failed."""
from __future__ import annotations

import os

from tessera.pickles import refused_file, refusal


def causal_lm_class(hf_config):
    """The transformers class AutoModelForCausalLM builds for `hf_config`, or None (remote code: only
    `from_config` with trust_remote_code knows it)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING  # start-up time: transformers loads when a model is made

    return MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)


def load_message(what: str, name: str, e: Exception) -> str:
    first = refusal(e)  # a pickle global the weights-only loader refused, by name; never its advice to turn it off
    if os.path.exists(name):
        refused = refused_file(name) if "GLOBAL" in str(e) else None
        if refused:
            return f"cannot load the {what} from the local folder {name!r}: {refused}"
        return f"cannot load the {what} from the local folder {name!r}: {first}"
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        return f"{name!r}: no such folder"
    return (f"{name!r} is not a local folder, and loading it as a hub id failed: {first.rstrip('.')}; "
            f"without hub access, give a local folder instead (a copy of the hub repository)")
