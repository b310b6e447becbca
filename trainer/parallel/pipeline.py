"""Pipeline parallelism as functions: cut a Hugging Face causal LM into stages, the stage module a schedule runs,
and torch's pipeline schedules by name.

A stage is the Hugging Face model itself with the other stages' blocks removed (the ModuleList keeps its
original indices, so parameter names are the full model's and checkpoints move between layouts), without the
embeddings or the final norm and head. A later stage runs the model's forward on the hidden states it receives
(`inputs_embeds`) and its first block takes them as they came: whatever the model does to its embeddings before
the first block (a multiplier, a norm, added positions) was done on the first stage. An earlier stage returns its
last block's output: whatever the model does after its blocks is done on the last stage. Per-layer settings that
the model's forward looks up by the position of a block in its list (attention types: sliding window, alternating
global/local) are cut to the stage's own blocks, so each block keeps its global layer's setting.
"""
from __future__ import annotations

import copy
from contextlib import nullcontext
from types import SimpleNamespace
from typing import List

import torch
from torch import nn

from models.init import base_model_path, decoder_blocks
from models.packing import PackedForward
from tessera.errors import ModelError

SCHEDULES = {
    # name: (torch class name, stages per rank: 1, "v" (2, V-shaped) or None (strategy.pp_stages_per_rank))
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", None),
    "looped_bfs": ("ScheduleLoopedBFS", None),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", None),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}
# Schedules that run the backward as separate input-gradient and weight-gradient passes (zero bubble).
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zb", "zbv", "dualpipev")


def stages_per_rank(s) -> int:
    kind = SCHEDULES.get(s.pp_schedule, (None, 1))[1]
    if kind == "v":
        return 2
    return s.pp_stages_per_rank if kind is None else 1


def stage_indices(pp_rank: int, pp: int, per_rank: int, v_shape: bool) -> List[int]:
    """Stages a pipeline rank holds: looped (r, r + p, ...) or V-shaped (r and 2p - 1 - r)."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


class ZeroPositions(nn.Module):
    """An additive position embedding on a later stage: the first stage added it already."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, *args, **kwargs):
        # Shaped by the first (batch, sequence) tensor it is given: GPT-2 passes position ids, OPT its attention
        # mask (then positions as a keyword).
        ref = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        return torch.zeros(*ref.shape[:2], self.dim, device=ref.device)


class Placeholder(nn.Identity):
    """A module of another stage, passing its input through. The split put it before the blocks ("before": it runs
    on the first stage) or after them ("after": on the last); if the model calls it on the other side of the
    blocks, the split took it for the wrong end and the stage would compute another model: an error then."""

    def __init__(self, path: str, side: str):
        super().__init__()
        self.path, self.side = path, side
        self.phase = None  # the stage's: "before", "blocks" or "after" (StageModule)

    def forward(self, *args, **kwargs):
        if self.phase is not None and self.phase.now not in (self.side, "blocks"):
            ran = "after" if self.side == "before" else "before"
            raise ModelError(f"strategy.pp: the model runs {self.path} {ran} its decoder blocks, but the pipeline "
                             f"split put it {self.side} them: this architecture cannot be cut into stages; set "
                             f"strategy.pp=1")
        return args[0] if args else next(iter(kwargs.values()))


class StageModule(nn.Module):
    """One pipeline stage: input ids (first stage) or hidden states in, hidden states or logits out. Every stage is
    given the same position ids where there are any (the schedule splits them into micro-batches as the inputs):
    `position_ids`, a context-parallel shard's (strategy.cp), or `packed_position_ids`, packed documents'
    (data.packing=documents: each stage's model builds its own mask from them, and its first packed forward
    checks that it kept the documents apart, as one process's does). Packed documents over context ranks: the
    shard's positions and `document_position_ids`, the micro-batch's whole rows, which the context group's
    attention masks by (`cp.micro_batch`).

    The stage's ends are its blocks: a later stage's first block takes the received hidden states in place of
    what the model's forward made of them, an earlier stage hands out its last block's output (hooks outside
    the blocks' activation checkpointing, so a recomputation does not run them)."""

    def __init__(self, lm: nn.Module, first: bool, last: bool, cp=None):
        super().__init__()
        self.lm = lm
        self.first, self.last = first, last
        self.packed_forward = PackedForward()
        self.cp = cp
        blocks = [b for _, b in decoder_blocks(lm)]
        # The module that runs the blocks (earlier stages stop there: the causal LM would hand out a view of its
        # hidden states, which the zero-bubble schedules' backward can't detach in place).
        path = base_model_path(lm)
        self.body = lm.get_submodule(path) if path else lm
        self._received = self._handed_out = None
        self.phase = SimpleNamespace(now="before")  # where the forward is: before, in or after the blocks
        for module in lm.modules():
            if isinstance(module, Placeholder):
                module.phase = self.phase
        blocks[0].register_forward_pre_hook(self._take_received, with_kwargs=True)
        blocks[-1].register_forward_hook(self._keep_output)

    def forward(self, x, position_ids=None, packed_position_ids=None, document_position_ids=None):
        model = self.lm if self.last else self.body
        inputs = {"input_ids": x} if self.first else {"input_ids": None, "inputs_embeds": x}
        self._received = None if self.first else x
        self.phase.now = "before"
        try:
            if packed_position_ids is not None:
                out = self.packed_forward(model, inputs.pop("input_ids"), packed_position_ids, **inputs)
            else:
                if position_ids is not None:
                    inputs["position_ids"] = position_ids
                documents = (nullcontext() if document_position_ids is None
                             else self.cp.micro_batch(document_position_ids))
                with documents:
                    out = model(**inputs, use_cache=False)
            return out.logits if self.last else self._handed_out
        finally:
            self._received = self._handed_out = None

    def _take_received(self, block, args, kwargs):
        self.phase.now = "blocks"
        if self.first:
            return None
        if args:
            return (self._received, *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise ModelError(f"strategy.pp: {type(block).__name__} is called without its hidden states as the first "
                             f"argument or hidden_states=, so a pipeline stage cannot hand it the previous stage's")
        return args, dict(kwargs, hidden_states=self._received)

    def _keep_output(self, block, args, output):
        self.phase.now = "after"
        if not self.last:
            self._handed_out = output[0] if isinstance(output, (tuple, list)) else output


def set_module(root: nn.Module, path: str, module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def cut_stage(part: nn.Module, split, first: bool, last: bool, layers: range) -> None:
    """Keep only this stage's blocks (original indices kept) and its end modules."""
    blocks = part.get_submodule(split.layers)
    names = [k for k, _ in blocks.named_children()]
    kept = sorted(int(k) for k in names if int(k) in layers)
    for k in names:
        if int(k) not in layers:
            delattr(blocks, k)  # Module.__delattr__ keeps the other keys (ModuleList's __delitem__ renumbers)
    _per_layer_settings_of(part, split, kept)
    if not first:  # what these modules made is replaced by the received hidden states (StageModule)
        embed = part.get_input_embeddings()
        for path in split.first:
            module = part.get_submodule(path)
            if path in split.zeroed_on_later_stages:
                set_module(part, path, ZeroPositions(module.embedding_dim))
            else:  # the token embedding is never called (inputs_embeds); a norm or projection passes through
                set_module(part, path, None if module is embed else Placeholder(path, "before"))
    if not last:
        for path in split.last:
            set_module(part, path, Placeholder(path, "after"))


def _per_layer_settings_of(part: nn.Module, split, kept: List[int]) -> None:
    """The module that owns the blocks reads per-layer lists of its config by the block's position in the list
    (`config.layer_types[i]` for the i-th block it runs): give it a config whose per-layer lists hold only the
    kept layers, in order. The blocks themselves read their settings by their global index at construction."""
    owner_path = split.layers.rpartition(".")[0]
    owner = part.get_submodule(owner_path) if owner_path else part
    config = getattr(owner, "config", None)
    if config is None:
        return
    n = getattr(config, "num_hidden_layers", None)
    lists = {k: v for k, v in vars(config).items() if isinstance(v, (list, tuple)) and n and len(v) == n}
    if not lists:
        return
    stage_config = copy.copy(config)  # the causal LM's own config (export, logits) stays the full model's
    for key, values in lists.items():
        setattr(stage_config, key, type(values)(values[i] for i in kept))
    owner.config = stage_config
