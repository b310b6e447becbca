"""Per-block transforms applied before any wrapper: activation checkpointing, then torch.compile (torchtitan's
apply_ac, apply_compile)."""
from __future__ import annotations

from models.init import decoder_blocks


def apply_activation_checkpointing(model, train_cfg, context_fn=None) -> None:
    """Hugging Face's non-reentrant activation checkpointing of every k-th decoder block; `context_fn` (torch's
    checkpoint argument): state a block's recomputation must see as its forward did."""
    if train_cfg.activation_checkpointing == "full":
        kwargs = {"use_reentrant": False, **({} if context_fn is None else {"context_fn": context_fn})}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs,
                                              every_n_layers=train_cfg.activation_checkpointing_every)


def apply_compile(model, train_cfg) -> None:
    """torch.compile per decoder block (inductor)."""
    if train_cfg.compile:
        for _, block in decoder_blocks(model):
            block.compile()
