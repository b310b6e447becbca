"""Which checkpoint tensors make each tensor of the model, as transformers' own loader decides.

`from_pretrained` (transformers 5) renames checkpoint keys and fuses some of them on load: GPT-NeoX's
`embed_out.weight` becomes `lm_head.weight`, Mixtral's `block_sparse_moe.experts.{i}.w1/w3.weight` are stacked per
expert and concatenated into `mlp.experts.gate_up_proj`, legacy `LayerNorm.gamma/beta` become `.weight/.bias`, ...
Those rules are declared per model type (or class) in `transformers.conversion_mapping` as `WeightRenaming` and
`WeightConverter` transforms. This module applies the very transforms `from_pretrained` would use for the model
(`get_model_conversion_mapping`, `rename_source_key`, in the key order of `convert_and_load_state_dict_in_model`),
so a new architecture with a declared mapping works without a table here. What it returns says which checkpoint
keys feed which model tensor; `models.weights` reads them and runs the converter's own operations on them.

Tied weights (`tie_word_embeddings`) follow `PreTrainedModel.tie_weights` as `from_pretrained` calls it: a tied
tensor that the checkpoint lacks is the one of its tie group that the checkpoint holds (the source first).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple


class Source:
    """The checkpoint keys of one model tensor. `converter` None: the tensor is checkpoint key `keys[None][0]`
    (maybe renamed). Otherwise transformers' `WeightConverter` (a template, never fed) makes it from `keys`
    ({source pattern: checkpoint keys, in the loader's order}); `first` is the name the loader keys the converter
    under (for a converter with several targets, e.g. a fused qkv split in three, the first target's name)."""

    __slots__ = ("first", "keys", "converter")

    def __init__(self, first: str, converter=None):
        self.first = first
        self.converter = converter
        self.keys: Dict[Optional[str], List[str]] = {}

    def all_keys(self) -> List[str]:
        """The checkpoint keys, in the converter's order of source patterns (the order it concatenates them)."""
        if self.converter is None:
            return list(self.keys.get(None, []))
        return [k for p in self.converter.source_patterns for k in self.keys.get(p, [])]

    def __repr__(self):
        kind = type(self.converter).__name__ if self.converter is not None else "key"
        return f"Source({self.first!r}, {kind}, {self.keys})"


def _targets(source: Source) -> List[str]:
    """The model names a converter writes: its target patterns put in place of the first one (as
    `WeightConverter.convert` names its outputs by the prefix and suffix around the first target)."""
    targets = source.converter.target_patterns
    if len(targets) <= 1 or targets[0] not in source.first:
        return [source.first]
    head, _, tail = source.first.partition(targets[0])
    return [head + t + tail for t in targets]


def model_sources(model, checkpoint_keys) -> Tuple[Dict[str, Source], Dict[str, str]]:
    """({model tensor name: Source} for every name of `model.state_dict()` that `from_pretrained` would fill from
    a checkpoint holding `checkpoint_keys`, {tied name: name holding its values} for the tied tensors the checkpoint
    lacks). `model` may be on the meta device."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    mapping = get_model_conversion_mapping(model)  # what from_pretrained uses (no key_mapping, no quantizer)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.state_dict()
    prefix = model.base_model_prefix

    sources: Dict[str, Source] = {}
    # the loader's order: renamings keep state (GroupWeightRename), and a converter stacks experts in this order
    for key in sorted(checkpoint_keys, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:  # as the loader: not to be renamed, perhaps to be prefixed
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
        if renamed not in meta:
            continue  # an unexpected key: from_pretrained drops it
        if pattern is not None:
            source = sources.setdefault(renamed, Source(renamed, by_pattern[pattern]))
            if source.converter is not None:
                source.keys.setdefault(pattern, []).append(key)
        else:
            source = sources.setdefault(renamed, Source(renamed))
            if source.converter is None:
                source.keys.setdefault(None, []).append(key)  # the loader takes the first of several

    for first, source in list(sources.items()):  # a converter with several targets (qkv -> q, k, v): all of them
        if source.converter is not None:
            for target in _targets(source):
                if target in meta:
                    sources.setdefault(target, source)

    return sources, _tied_aliases(model, sources)


def _tied_aliases(model, sources: Dict[str, Source]) -> Dict[str, str]:
    """{tied name absent from the checkpoint: the name of its tie group the checkpoint holds}, as
    `tie_weights(missing_keys=...)` ties on load: the source if present, else a present target (swapped in)."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is None:
        tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    groups: Dict[str, List[str]] = {}
    for target, source in tied.items():
        groups.setdefault(source, [source]).append(target)
    aliases = {}
    for members in groups.values():
        present = [n for n in members if n in sources]
        if not present:
            continue  # both absent: from_pretrained leaves them initialized, and so missing here
        for n in members:
            if n not in sources:
                aliases[n] = present[0]
    return aliases
