"""Reading a pretrained checkpoint tensor by tensor, or a slice of one, without loading the whole model.

Sharding strategies build the model empty and ask each parameter's rows from here, so that each rank reads
only the part it owns (safetensors files are memory-mapped; a slice reads only its bytes). `pytorch_model.bin`
checkpoints are memory-mapped through torch.load. Names are the model's parameter names; checkpoints saved
from the base model (without the causal LM's prefix, e.g. GPT-2's `h.0...` for `transformer.h.0...`) are
matched too.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch

from trainer.errors import ModelError


def _local_folder(m) -> str:
    if os.path.isdir(m.name_or_path):
        return m.name_or_path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(m.name_or_path, revision=m.revision,
                                 allow_patterns=["*.safetensors", "*.json", "*.bin"])
    except Exception as e:  # noqa: BLE001 - hub errors come in many types
        from models.registry import _load_message

        raise ModelError("model.name_or_path: " + _load_message("model weights", m.name_or_path, e)) from None


class PretrainedWeights:
    """The tensors of a local or hub checkpoint, by name; `read(name, rows)` returns them (or rows of them)
    as stored (dtype of the file)."""

    def __init__(self, m, base_model_prefix: str = ""):
        self.folder = _local_folder(m)
        self.name_or_path = m.name_or_path
        self.prefix = base_model_prefix
        self._files: Dict[str, str] = {}  # checkpoint key -> file
        self._open = {}
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

    def _handle(self, path: str):
        if path not in self._open:
            try:
                if path.endswith(".safetensors"):
                    from safetensors import safe_open

                    self._open[path] = safe_open(path, framework="pt")
                else:
                    self._open[path] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:  # noqa: BLE001 - a missing, truncated or foreign file: one clear message
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ModelError(f"model.name_or_path={self.name_or_path!r}: cannot read the checkpoint file "
                                 f"{path}: {first}") from None
        return self._open[path]

    def _keys_of(self, path: str):
        handle = self._handle(path)
        return list(handle.keys())

    def key(self, name: str) -> Optional[str]:
        """The checkpoint's key for model tensor `name`, or None."""
        if name in self._files:
            return name
        p = self.prefix + "."
        if self.prefix and name.startswith(p) and name[len(p):] in self._files:
            return name[len(p):]
        if self.prefix and p + name in self._files:
            return p + name
        return None

    def shape(self, name: str):
        key = self.key(name)
        handle = self._handle(self._files[key])
        if hasattr(handle, "get_slice"):
            return list(handle.get_slice(key).get_shape())
        return list(handle[key].shape)

    def read(self, name: str, index=None) -> torch.Tensor:
        """The tensor, or its block at `index` (a slice of rows, or a tuple of slices, one per dimension)."""
        key = self.key(name)
        handle = self._handle(self._files[key])
        if hasattr(handle, "get_slice"):
            part = handle.get_slice(key)
            return part[index] if index is not None else part[:]
        tensor = handle[key]
        return (tensor[index] if index is not None else tensor).clone()

    def missing(self, names) -> list:
        return [n for n in names if self.key(n) is None]

    def close(self) -> None:
        self._open.clear()
