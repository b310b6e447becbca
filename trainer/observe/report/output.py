"""Writes into the report folder: each file whole or not at all (a temporary name, then a rename)."""
from __future__ import annotations

import os
from typing import Callable

from tessera.errors import FaultError, one_line
from trainer.observe.report.runs import ReportError


def write_atomic(path: str, write: Callable) -> None:
    """`write(fh)` into a hidden temporary file next to `path` (binary), then rename it to `path`: a reader
    never sees half a file, and a failed write leaves the old one."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise FaultError(f"writing {path} failed: {one_line(e)}; free space or pass another --out DIR") from None
    except BaseException:
        _remove(tmp)
        raise


def make_folder(path: str) -> None:
    """The report folder (a bad --out: exit 2; a write that fails later is a fault, exit 4)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ReportError(f"cannot create the report folder {path}: {one_line(e)}; pass another --out DIR") from None


def remove_stale(path: str) -> None:
    """A figure an earlier report wrote that this one skips: gone, so the folder shows what report.md names."""
    _remove(path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
