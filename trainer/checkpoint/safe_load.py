"""Loading files without running code from them: every unpickling in Tessera goes through here.

Pickle can call any importable function while it loads (a `GLOBAL` opcode names it, `REDUCE` calls it), so every
file that is a pickle is read with an exact allow-list of (module, qualified name) pairs and nothing else:

- DCP's `.metadata` (sharded checkpoints of every torch-native strategy): `_DCPMetadataUnpickler`, whose list is
  `DCP_METADATA_GLOBALS`. Pairs match exactly: no prefix of a module, no dotted name looked up attribute by
  attribute (pickle protocol 4 would resolve `os.system` inside any allowed module otherwise).
- Tensor files written by `torch.save` (DCP shards, per-rank RNG state, pretrained `pytorch_model.bin`):
  `torch.load(weights_only=True)`, whose unpickler admits tensors, plain containers and primitive types, by
  exact name (`load_tensors`).
- DeepSpeed's checkpoint files (`<checkpoint>/zero/*.pt`, its universal conversion): DeepSpeed reads them with
  `torch.load(weights_only=False)`. `check_deepspeed_files` first reads every one of them with
  `weights_only=True` (memory-mapped: no tensor data is read) admitting exactly the DeepSpeed classes that real
  ZeRO-1/2/3 checkpoints hold (`DEEPSPEED_GLOBALS`), on every rank, before DeepSpeed opens any: a refused file
  stops every rank with the same message. `deepspeed_loads_weights_only()` then makes DeepSpeed's own reads
  weights-only too (same list), for as long as it loads, converts or exports.

A refusal is a CheckpointError (exit code 2) naming the file and the global it refers to; nothing of the file
ran.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
from typing import List, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from tessera.errors import CheckpointError, TesseraError
from tessera.pickles import load_tensors, refusal


# --------------------------------------------------------------------------------------------------------
# DCP's pickled metadata.

# Found by dumping the GLOBAL / STACK_GLOBAL opcodes (pickletools) of the `.metadata` files that this torch writes
# for strategy=single, ddp, fsdp, tp, pp and fsdp_tp (fp32 and bf16): exactly these, on every family.
DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # torch.strided and the other layouts pickle through it
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the folder it was saved to
    ("pathlib._local", "PosixPath"),  # the same class where Python 3.13+ pickles it under its own module
})
# A tensor's dtype pickles as a global of torch by its name (`torch.float32`): each dtype's name, exactly.
DCP_METADATA_GLOBALS |= frozenset(("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))


class _DCPMetadataUnpickler(pickle.Unpickler):
    """DCP pickles its `.metadata`: admit only its own record types and the torch values they hold, by exact
    (module, name) pair."""

    def __init__(self, fh, path: str = ".metadata"):
        super().__init__(fh)
        self.path = path

    def find_class(self, module, name):
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path} refers to {module}.{name}, which a checkpoint never holds; refusing to load it "
                     f"(nothing of it ran)")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            metadata = _DCPMetadataUnpickler(fh, str(path)).load()
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


# --------------------------------------------------------------------------------------------------------
# torch.save files.







# --------------------------------------------------------------------------------------------------------
# DeepSpeed's checkpoint files.

# The classes (besides tensors, storages and plain containers, which weights-only loading admits itself) in real
# ZeRO-1/2/3 checkpoints, found by dumping the globals of every file that zero1, zero2, zero3 and zero3_offload runs
# (fp32, bf16, fp16, optimizer offload) and their universal conversions write: the ZeRO stage enum, the loss
# scalers and ZeRO-1/2's fragment addresses (`param_slice_mappings`). Exact (module, name) pairs.
DEEPSPEED_GLOBALS = (
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def deepspeed_globals() -> list:
    """DEEPSPEED_GLOBALS as the objects torch.serialization.safe_globals takes."""
    import importlib

    return [getattr(importlib.import_module(module), name) for module, name in DEEPSPEED_GLOBALS]


def deepspeed_files(folder: str) -> List[str]:
    """Every torch.save file under `folder` (the ones DeepSpeed may read), sorted."""
    out = []
    for base, _, files in os.walk(folder):
        out += [os.path.join(base, f) for f in files if f.endswith(".pt")]
    return sorted(out)


def check_deepspeed_files(folder: str) -> None:
    """Read every DeepSpeed checkpoint file under `folder` weights-only (memory-mapped, so without reading the
    tensor data): a file that refers to anything but tensors, plain containers and DEEPSPEED_GLOBALS is refused
    with a CheckpointError naming it. Call it before DeepSpeed opens the folder, on every rank."""
    safe = deepspeed_globals()
    what = "DeepSpeed checkpoint file"
    for path in deepspeed_files(folder):
        try:
            try:
                load_tensors(path, what, extra_globals=safe, map_location="cpu", mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                # torch's legacy (non-zip) format cannot be memory-mapped: read it whole
                load_tensors(path, what, extra_globals=safe, map_location="cpu")
        except TesseraError:
            raise
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file: one message naming it
            raise CheckpointError(f"{what} {path} is damaged: {refusal(e)}; resume from another checkpoint") from None


@contextlib.contextmanager
def deepspeed_loads_weights_only():
    """While active, DeepSpeed's own torch.load calls (weights_only=False in its engine, ds_to_universal,
    zero_to_fp32 and universal loaders) load weights-only with DEEPSPEED_GLOBALS: even a file swapped after
    check_deepspeed_files cannot run code. Not reentrant across threads; DeepSpeed loads on the main thread."""
    safe = deepspeed_globals()
    original = torch.load

    def load(f, map_location=None, pickle_module=None, **kwargs):
        kwargs.pop("weights_only", None)
        with torch.serialization.safe_globals(safe):
            return original(f, map_location=map_location, weights_only=True, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def checked_deepspeed_folder(folder: Optional[str]):
    """check_deepspeed_files(folder), then deepspeed_loads_weights_only() for the block."""
    if folder is not None:
        check_deepspeed_files(folder)
    return deepspeed_loads_weights_only()
