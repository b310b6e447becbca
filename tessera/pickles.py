"""Reading torch pickles (`torch.save` files: DCP shards, RNG state, pretrained `pytorch_model.bin`) without
running code from them: `torch.load(weights_only=True)`, whose unpickler admits tensors, plain containers and
primitive types by exact name. A file that names anything else is refused with one message naming the file and
the global (trainer/checkpoint/safe_load.py holds the allow-lists of DCP metadata and DeepSpeed files)."""
from __future__ import annotations

import os
import pickle
import re
from typing import Iterable

import torch

from tessera.errors import CheckpointError, one_line


def refusal(e: BaseException) -> str:
    """What the weights-only unpickler refused, in one line (never its advice to turn weights_only off)."""
    text = str(e)
    m = re.search(r"GLOBAL ([\w.]+)", text)
    if m:
        return f"it refers to {m.group(1)}, which such a file never holds"
    lines = [line.strip() for line in text.splitlines() if line.strip() and "weights_only" not in line
             and "Weights only load failed" not in line]
    return one_line(e, lines[0] if lines else "")


def load_tensors(path: str, what: str = "checkpoint file", error=None, extra_globals: Iterable = (), **kwargs):
    """torch.load(path, weights_only=True); a file that refers to anything else is refused with `error` (a
    CheckpointError by default) naming the file and the global."""
    try:
        with torch.serialization.safe_globals(list(extra_globals)):
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        if "GLOBAL" in str(e):
            message = f"{what} {path}: {refusal(e)}; refusing to load it (nothing of it ran)"
        else:
            message = f"{what} {path} is damaged: {refusal(e)}"
        raise (error or CheckpointError)(message) from None


def refused_file(folder: str):
    """The refusal message (naming the file and the global) of the first torch pickle (`*.bin`, `*.pt`,
    `*.pth`) in `folder` that a weights-only load refuses, or None: names the file behind a library's error."""
    if not os.path.isdir(folder):
        return None
    for name in sorted(os.listdir(folder)):
        if name.endswith((".bin", ".pt", ".pth")):
            try:
                load_tensors(os.path.join(folder, name), "", error=ValueError, map_location="cpu", mmap=True)
            except ValueError as e:
                if "refers to" in str(e):
                    return str(e).strip()
            except Exception:  # noqa: BLE001 - not a torch file: not the one refused
                continue
    return None
