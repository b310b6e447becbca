"""Packed documents on the model side (data.packing=documents): several documents in one sequence, position ids
restarting at each. Hugging Face models that build their masks with `transformers.masking_utils` from the
position ids read that as packed sequences and keep attention inside each document (block-diagonal masks for
SDPA / eager / flex, the varlen path of flash-attention). Whether a model does is checked twice: its forward must
take position_ids (before any process group starts), and the first forward on a packed batch must have gone
through transformers' packed-sequence detection and found the documents; a model that ignores them would
silently attend across documents, so that is an error.
"""
from __future__ import annotations

import inspect
import weakref

import torch

from models.loading import causal_lm_class
from tessera.errors import ModelError


def takes_position_ids(hf_config) -> bool:
    """Whether the causal LM's forward takes position_ids (remote code: not assumed)."""
    model_class = causal_lm_class(hf_config)
    return model_class is not None and "position_ids" in inspect.signature(model_class.forward).parameters


class PackedForward:
    """model(input_ids, position_ids) that verifies, on each model's first packed batch, that the model kept the
    documents apart (per model: a process may train several, one after another: a Hydra multirun, a test worker)."""

    def __init__(self):
        self._verified = weakref.WeakSet()

    @property
    def verified(self) -> bool:
        """Whether a model has been verified on a packed batch."""
        return len(self._verified) > 0

    def __call__(self, model, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs):
        if model in self._verified:
            return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        from transformers import masking_utils

        found = []
        detect = masking_utils.find_packed_sequence_indices

        def watched(ids):
            result = detect(ids)
            found.append(result is not None)
            return result

        masking_utils.find_packed_sequence_indices = watched
        try:
            out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        finally:
            masking_utils.find_packed_sequence_indices = detect
        packed = bool((torch.diff(position_ids, dim=-1) != 1).any())  # some row holds two pieces
        if packed and not any(found):
            name = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise ModelError(f"data.packing=documents: the {name} model does not read restarting position ids as "
                             f"packed documents (its attention mask ignores them), so documents would attend to "
                             f"each other; use data.packing=eos")
        if packed:
            self._verified.add(model)
        return out
