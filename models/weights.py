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
from tessera.errors import ModelError, one_line

log = logging.getLogger(__name__)


def _local_folder(m) -> str:
    if os.path.isdir(m.name_or_path):
        return m.name_or_path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(m.name_or_path, revision=m.revision,
                                 allow_patterns=["*.safetensors", "*.json", "*.bin"])
    except Exception as e:  # noqa: BLE001 - hub errors come in many types
        from models.registry import load_message

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


class PretrainedWeights:
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
        self._open = {}
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
    def _handle(self, path: str):
        if path not in self._open:
            try:
                if path.endswith(".safetensors"):
                    from safetensors import safe_open

                    self._open[path] = safe_open(path, framework="pt")
                else:
                    self._open[path] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:  # noqa: BLE001 - a missing, truncated or foreign file: one clear message
                from tessera.pickles import refusal  # a pickle global the weights-only loader refused, by name

                raise ModelError(f"model.name_or_path={self.name_or_path!r}: cannot read the checkpoint file "
                                 f"{path}: {refusal(e)}") from None
        return self._open[path]

    def _keys_of(self, path: str):
        handle = self._handle(path)
        return list(handle.keys())

    def _key_shape(self, key: str) -> list:
        if key not in self._shapes:
            handle = self._handle(self._files[key])
            if hasattr(handle, "get_slice"):
                self._shapes[key] = list(handle.get_slice(key).get_shape())
            else:
                self._shapes[key] = list(handle[key].shape)
        return self._shapes[key]

    def _read_key(self, key: str, index=None) -> torch.Tensor:
        handle = self._handle(self._files[key])
        if hasattr(handle, "get_slice"):
            part = handle.get_slice(key)
            return part[index] if index is not None else part[:]
        tensor = handle[key]
        return (tensor[index] if index is not None else tensor).clone()

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
            from transformers import AutoConfig, AutoModelForCausalLM

            from models.init import meta_model
            from models.registry import causal_lm_class

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
        from transformers.core_model_loading import Concatenate, MergeModulelist

        kinds = [type(op) for op in source.converter.operations]
        if target != source.first or kinds not in ([MergeModulelist], [Concatenate], [MergeModulelist, Concatenate]):
            return None
        index = index if isinstance(index, tuple) else (index,)
        shape = self.shape(target)
        if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
            return None
        index = index + (slice(None),) * (len(shape) - len(index))
        ranges = [s.indices(n) for s, n in zip(index, shape)]
        if any(r[2] <= 0 or len(range(*r)) == 0 for r in ranges):
            return None
        merge = source.converter.operations[0] if kinds[0] is MergeModulelist else None
        concat = source.converter.operations[-1] if kinds[-1] is Concatenate else None
        patterns = [p for p in source.converter.source_patterns if p in source.keys]
        if sorted(patterns) != sorted(source.keys):
            return None
        pieces = []  # (pattern, position in its list or None for the stacked list, shape of the piece)
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
        if any(len(piece) != len(shape) for _, _, piece in pieces):
            return None
        piece_ranges = []
        if concat is not None:
            d = concat.dim % len(shape)
            start, stop, step = ranges[d]
            if step != 1:
                return None
            offset = 0
            for p, i, piece in pieces:
                lo, hi = max(start, offset), min(stop, offset + piece[d])
                local = list(ranges)
                local[d] = (lo - offset, max(lo, hi) - offset, 1)  # maybe empty: a part the block does not reach
                piece_ranges.append((p, i, local))
                offset += piece[d]
            if offset != shape[d]:
                return None
        else:
            piece_ranges = [(p, i, ranges) for p, i, _ in pieces]
        reads: Dict[str, list] = {p: [] for p in patterns}
        for p, i, r in piece_ranges:
            keys = source.keys[p]
            if merge is not None:
                m = merge.dim % len(shape)
                positions = range(*r[m])
                if len(positions) == 0:
                    return None
                per_key = tuple(slice(*x) for j, x in enumerate(r) if j != m)
                reads[p].extend((keys[pos], per_key) for pos in positions)
            else:
                reads[p].append((keys[i], tuple(slice(*x) for x in r)))
        return reads

    def close(self) -> None:
        self._open.clear()
