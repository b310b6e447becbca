"""Reading a pretrained checkpoint tensor by tensor, or a slice of one, without loading the whole model.

Sharding strategies build the model empty and ask each parameter's rows from here, so that each rank reads
only the part it owns (safetensors files are memory-mapped; a slice reads only its bytes). `pytorch_model.bin`
checkpoints are memory-mapped through torch.load(weights_only=True): tensors and plain containers only, a file
that refers to anything else is refused by name (no code from it runs). Names are the model's parameter names,
mapped to checkpoint keys by transformers' own loading rules (models/checkpoint_keys.py): renamed keys,
per-expert tensors fused into the model's 3-D expert parameters, tied weights, and checkpoints saved from the
base model (without the causal LM's prefix, e.g. GPT-2's `h.0...` for `transformer.h.0...`).
"""
from __future__ import annotations

import copy
import json
import logging
import os
from typing import Dict, List, Optional

import torch

from models.checkpoint_keys import Source, model_sources
from models.init import meta_model
from models.loading import causal_lm_class, load_message
from tessera.errors import ModelError, one_line
from tessera.pickles import refusal

log = logging.getLogger(__name__)


def _local_folder(m) -> str:
    if os.path.isdir(m.name_or_path):
        return m.name_or_path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(m.name_or_path, revision=m.revision,
                                 allow_patterns=["*.safetensors", "*.json", "*.bin"])
    except Exception as e:  # noqa: BLE001 - hub errors come in many types
        raise ModelError("model.name_or_path: " + load_message("model weights", m.name_or_path, e)) from None


_UNSET = object()


class _Mapping:
    """transformers' view of the checkpoint: the model on the meta device, {model name: Source}, tied aliases."""

    def __init__(self, model, sources, aliases):
        self.model = model
        self.sources = sources
        self.aliases = aliases
        self.names = set(model.state_dict())
        # the model's tensors from_pretrained never loads (non-persistent buffers such as rotary inv_freq)
        self.unloaded = {n for n, _ in model.named_buffers(remove_duplicate=False)} - self.names


class CheckpointWeights:
    """A pretrained checkpoint read tensor by tensor (PretrainedWeights; models.lora.AdaptedWeights over one), as
    strategies receive it in place of seeded init units: test for it with isinstance, never by its methods."""

    folder: str

    def key(self, name: str) -> Optional[str]:
        raise NotImplementedError

    def missing(self, names) -> list:
        raise NotImplementedError

    def shape(self, name: str):
        raise NotImplementedError

    def read(self, name: str, index=None) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def is_checkpoint(initial) -> bool:
    """Whether a strategy's initial weights are a checkpoint to read (else: seeded init units, or None)."""
    return isinstance(initial, CheckpointWeights)


class _File:
    """An open checkpoint file: a memory-mapped safetensors file (read by slices) or a torch pickle's tensors."""

    __slots__ = ("handle", "safetensors")

    def __init__(self, handle, safetensors: bool):
        self.handle, self.safetensors = handle, safetensors

    def keys(self):
        return self.handle.keys()

    def shape(self, key: str) -> list:
        if self.safetensors:
            return list(self.handle.get_slice(key).get_shape())
        return list(self.handle[key].shape)

    def read(self, key: str, index=None) -> torch.Tensor:
        if self.safetensors:
            # get_tensor for the whole tensor: a slice of a 0-dim tensor (Apertus' activation scalars) is refused
            return self.handle.get_slice(key)[index] if index is not None else self.handle.get_tensor(key)
        tensor = self.handle[key]
        return (tensor[index] if index is not None else tensor).clone()


class PretrainedWeights(CheckpointWeights):
    """The tensors of a local or hub checkpoint, by the model's names; `read(name, index)` returns them (or a block
    of them) as `from_pretrained` would put them into the model, in the dtype of the file.

    With the checkpoint's config.json, names follow transformers' own loading rules for the model
    (models/checkpoint_keys.py): renamed keys (GPT-NeoX's `embed_out` -> `lm_head`, legacy `gamma`/`beta`), fused
    tensors (the per-expert weights of Mixtral / Qwen-MoE stacked into `experts.gate_up_proj` / `down_proj`, made by
    the converter's own operations) and tied weights the checkpoint leaves out. Without a config (or when
    transformers cannot build the model) a name is the checkpoint key, with or without the base_model_prefix."""

    def __init__(self, m, base_model_prefix: str = ""):
        self.folder = _local_folder(m)
        self.name_or_path = m.name_or_path
        self.prefix = base_model_prefix
        self._m = m
        self._files: Dict[str, str] = {}  # checkpoint key -> file
        self._open: Dict[str, _File] = {}
        self._mapping_cache = _UNSET
        self._shapes: Dict[str, list] = {}  # checkpoint key -> shape
        self._converted_shapes: Dict[str, list] = {}  # model name of a converted tensor -> shape
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            path = os.path.join(self.folder, index_name)
            if os.path.exists(path):
                with open(path) as fh:
                    weight_map = json.load(fh)["weight_map"]
                self._files = {k: os.path.join(self.folder, f) for k, f in weight_map.items()}
                break
        else:
            for single in ("model.safetensors", "pytorch_model.bin"):
                path = os.path.join(self.folder, single)
                if os.path.exists(path):
                    self._files = {k: path for k in self._keys_of(path)}
                    break
        if not self._files:
            raise ModelError(f"model.name_or_path={m.name_or_path!r}: no model.safetensors or pytorch_model.bin "
                             f"(nor their .index.json) in {self.folder}")

    # ---- files ----------------------------------------------------------------------------------------------
    def _handle(self, path: str) -> _File:
        if path not in self._open:
            safetensors = path.endswith(".safetensors")
            try:
                if safetensors:
                    from safetensors import safe_open  # start-up time: read only when a checkpoint is

                    self._open[path] = _File(safe_open(path, framework="pt"), safetensors=True)
                else:
                    self._open[path] = _File(torch.load(path, map_location="cpu", mmap=True, weights_only=True),
                                             safetensors=False)
            except Exception as e:  # noqa: BLE001 - a missing, truncated or foreign file: one clear message
                # refusal: a pickle global the weights-only loader refused, by name
                raise ModelError(f"model.name_or_path={self.name_or_path!r}: cannot read the checkpoint file "
                                 f"{path}: {refusal(e)}") from None
        return self._open[path]

    def _keys_of(self, path: str):
        return list(self._handle(path).keys())

    def _key_shape(self, key: str) -> list:
        if key not in self._shapes:
            self._shapes[key] = self._handle(self._files[key]).shape(key)
        return self._shapes[key]

    def _read_key(self, key: str, index=None) -> torch.Tensor:
        return self._handle(self._files[key]).read(key, index)

    # ---- names: transformers' loading rules -------------------------------------------------------------------
    def _mapping(self) -> Optional[_Mapping]:
        """transformers' key mapping for this checkpoint (built once, on the meta device), or None."""
        if self._mapping_cache is _UNSET:
            self._mapping_cache = self._build_mapping()
        return self._mapping_cache

    def _build_mapping(self) -> Optional[_Mapping]:
        if not os.path.exists(os.path.join(self.folder, "config.json")):
            return None  # a bare state dict: names are checkpoint keys
        try:
            from transformers import AutoConfig, AutoModelForCausalLM  # start-up time

            trust = bool(getattr(self._m, "trust_remote_code", False))
            where, kwargs = self.folder, {}
            if trust and not os.path.isdir(self.name_or_path):  # remote code lives next to the hub config
                where, kwargs = self.name_or_path, {"revision": getattr(self._m, "revision", None)}
            config = AutoConfig.from_pretrained(where, trust_remote_code=trust, **kwargs)
            if causal_lm_class(config) is None and trust:
                with torch.device("meta"):  # remote code: only from_config knows the class
                    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
            else:
                model = meta_model(config)
            sources, aliases = model_sources(model, self._files)
        except Exception as e:  # noqa: BLE001 - no mapping is the behaviour of before: keys as they are
            first = one_line(e)
            log.warning("model.name_or_path=%r: transformers' key mapping is not available (%s); reading the "
                        "checkpoint keys as they are", self.name_or_path, first)
            return None
        return _Mapping(model, sources, aliases)

    def _plain_key(self, name: str) -> Optional[str]:
        if name in self._files:
            return name
        p = self.prefix + "."
        if self.prefix and name.startswith(p) and name[len(p):] in self._files:
            return name[len(p):]
        if self.prefix and p + name in self._files:
            return p + name
        return None

    def _resolve(self, name: str):
        """(the model name whose checkpoint values `name` takes (itself, or the one it is tied to), its Source),
        or (name, None) when the checkpoint does not hold it."""
        mapping = self._mapping()
        if mapping is not None and name in mapping.names:
            name = mapping.aliases.get(name, name)
            return name, mapping.sources.get(name)
        if mapping is not None and name in mapping.unloaded:
            return name, None  # from_pretrained keeps what the model builds, whatever the checkpoint holds
        key = self._plain_key(name)  # not a name of the model (or no mapping): the checkpoint key
        if key is None:
            return name, None
        source = Source(name)
        source.keys[None] = [key]
        return name, source

    def _source(self, name: str):
        target, source = self._resolve(name)
        if source is None:
            raise KeyError(f"{name!r}: the checkpoint in {self.folder} does not hold it")
        return target, source

    def key(self, name: str) -> Optional[str]:
        """The checkpoint's key for model tensor `name` (for a tensor that transformers makes from several, e.g.
        fused experts, the first of them; `sources` lists all), or None when the checkpoint lacks it."""
        source = self._resolve(name)[1]
        return source.all_keys()[0] if source is not None else None

    def sources(self, name: str) -> List[str]:
        """Every checkpoint key that model tensor `name` is made of ([] when the checkpoint lacks it)."""
        source = self._resolve(name)[1]
        return source.all_keys() if source is not None else []

    def missing(self, names) -> list:
        return [n for n in names if self._resolve(n)[1] is None]

    # ---- values -----------------------------------------------------------------------------------------------
    def _convert(self, source, collected: Dict[str, list]) -> Dict[str, torch.Tensor]:
        """transformers' converter for `source` run on `collected` ({source pattern: tensors}): {name: tensor}."""
        model = self._mapping().model
        converter = copy.deepcopy(source.converter)  # the loader feeds a fresh copy per target, too
        for pattern, tensors in collected.items():
            for tensor in tensors:
                converter.add_tensor(source.first, pattern, pattern, tensor)
        out = converter.convert(source.first, model=model, config=model.config)
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}

    def _converted(self, target: str, source, collected) -> torch.Tensor:
        out = self._convert(source, collected)
        if target not in out:
            raise ModelError(f"model.name_or_path={self.name_or_path!r}: transformers' conversion of "
                             f"{source.all_keys()[:3]} made {sorted(out)}, not {target!r}")
        return out[target]

    def shape(self, name: str):
        target, source = self._source(name)
        if source.converter is None:
            return list(self._key_shape(source.keys[None][0]))
        if target not in self._converted_shapes:
            collected = {p: [torch.empty(self._key_shape(k), device="meta") for k in keys]
                         for p, keys in source.keys.items()}  # the converter's own ops, on shapes only
            self._converted_shapes[target] = list(self._converted(target, source, collected).shape)
        return list(self._converted_shapes[target])

    def read(self, name: str, index=None) -> torch.Tensor:
        """The tensor, or its block at `index` (a slice of rows, or a tuple of slices, one per dimension)."""
        target, source = self._source(name)
        if source.converter is None:
            return self._read_key(source.keys[None][0], index)
        if index is not None:
            parts = self._block_reads(target, source, index)
            if parts is not None:  # only the per-expert tensors (and their slices) the block is made of
                collected = {p: [self._read_key(k, i) for k, i in reads] for p, reads in parts.items()}
                return self._converted(target, source, collected)
        collected = {p: [self._read_key(k) for k in keys] for p, keys in source.keys.items()}
        full = self._converted(target, source, collected)
        return full[index].clone() if index is not None else full

    def _block_reads(self, target: str, source, index):
        """{source pattern: [(checkpoint key, index)]} that give block `index` of a converted tensor when the
        converter's operations are given them in place of the whole tensors, or None (read whole, then slice).
        That holds for transformers' stacking per expert (MergeModulelist) and concatenation (Concatenate): a
        block picks experts, and rows of the concatenated parts."""
        from transformers.core_model_loading import Concatenate, MergeModulelist  # start-up time

        kinds = [type(op) for op in source.converter.operations]
        if target != source.first or kinds not in ([MergeModulelist], [Concatenate], [MergeModulelist, Concatenate]):
            return None
        shape = self.shape(target)
        ranges = _block_ranges(index, shape)
        if ranges is None:
            return None
        merge = source.converter.operations[0] if kinds[0] is MergeModulelist else None
        concat = source.converter.operations[-1] if kinds[-1] is Concatenate else None
        patterns = [p for p in source.converter.source_patterns if p in source.keys]
        if sorted(patterns) != sorted(source.keys):
            return None
        pieces = self._pieces(source, patterns, merge)
        if pieces is None or any(len(piece) != len(shape) for _, _, piece in pieces):
            return None
        if concat is not None:
            piece_ranges = _concatenated_ranges(pieces, ranges, concat.dim % len(shape), shape)
            if piece_ranges is None:
                return None
        else:
            piece_ranges = [(p, i, ranges) for p, i, _ in pieces]
        return _piece_reads(source, patterns, piece_ranges, merge, len(shape))

    def _pieces(self, source, patterns: List[str], merge) -> Optional[list]:
        """[(pattern, position in its list or None for the stacked list, shape of the piece)] in the converter's
        order: with MergeModulelist, each pattern's tensors stacked (they must share one shape), else each tensor
        on its own; None when they do not stack."""
        pieces = []
        for p in patterns:
            keys = source.keys[p]
            if merge is not None:
                shapes = {tuple(self._key_shape(k)) for k in keys}
                if len(shapes) != 1:
                    return None
                stacked = list(shapes.pop())
                stacked.insert(merge.dim % (len(stacked) + 1), len(keys))
                pieces.append((p, None, stacked))
            else:
                pieces.extend((p, i, self._key_shape(k)) for i, k in enumerate(keys))
        return pieces

    def close(self) -> None:
        self._open.clear()


def _block_ranges(index, shape) -> Optional[list]:
    """Block `index` (a slice, or a tuple of slices) of a tensor of `shape` as one (start, stop, step) per
    dimension, or None when it is not a non-empty block of forward slices."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
        return None
    index = index + (slice(None),) * (len(shape) - len(index))
    ranges = [s.indices(n) for s, n in zip(index, shape)]
    if any(r[2] <= 0 or len(range(*r)) == 0 for r in ranges):
        return None
    return ranges


def _concatenated_ranges(pieces: list, ranges: list, d: int, shape) -> Optional[list]:
    """[(pattern, position, ranges in the piece)]: the block's `ranges` cut where the pieces are concatenated
    along dimension `d` (a piece the block does not reach gets an empty range there); None for a strided range
    along `d`, or pieces that do not add up to the tensor."""
    start, stop, step = ranges[d]
    if step != 1:
        return None
    piece_ranges, offset = [], 0
    for p, i, piece in pieces:
        lo, hi = max(start, offset), min(stop, offset + piece[d])
        local = list(ranges)
        local[d] = (lo - offset, max(lo, hi) - offset, 1)  # maybe empty: a part the block does not reach
        piece_ranges.append((p, i, local))
        offset += piece[d]
    if offset != shape[d]:
        return None
    return piece_ranges


def _piece_reads(source, patterns: List[str], piece_ranges: list, merge, ndim: int) -> Optional[Dict[str, list]]:
    """{pattern: [(checkpoint key, index)]} for the pieces' ranges: with MergeModulelist, one read per expert the
    range picks along the stacked dimension (None when it picks none), else one read per tensor."""
    reads: Dict[str, list] = {p: [] for p in patterns}
    for p, i, r in piece_ranges:
        keys = source.keys[p]
        if merge is not None:
            m = merge.dim % ndim
            positions = range(*r[m])
            if len(positions) == 0:
                return None
            per_key = tuple(slice(*x) for j, x in enumerate(r) if j != m)
            reads[p].extend((keys[pos], per_key) for pos in positions)
        else:
            reads[p].append((keys[i], tuple(slice(*x) for x in r)))
    return reads
