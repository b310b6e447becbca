"""Live snapshots of the model in training (`export.snapshot_every`), for a model that serves while it learns.

Every `export.snapshot_every` steps the model is exported as a Hugging Face folder to
`<run dir>/snapshots/step_N` (written under a temporary name and renamed into place when complete), then
`snapshots/current`, a relative symlink, is switched to it with one rename (atomic on POSIX): a process that
loads `snapshots/current` at any moment gets a complete model, the previous one or the new one. The last
`export.snapshot_keep` snapshots are kept (at least 2, so a reader that resolved `current` just before a switch
still finds its folder while it loads); older ones are removed, never the one `current` names.
"""
from __future__ import annotations

import os
import re
import shutil

STEP = re.compile(r"step_(\d+)$")


class Snapshots:
    def __init__(self, run_dir: str, every: int, keep: int, writes: bool):
        self.root = os.path.join(run_dir, "snapshots")
        self.every, self.keep, self.writes = every, keep, writes
        if every and writes:
            os.makedirs(self.root, exist_ok=True)
            for name in os.listdir(self.root):  # what an interrupted run left half-written
                if name.endswith(".tmp"):
                    path = os.path.join(self.root, name)
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        os.remove(path)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def folder(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step}")

    def publish(self, step: int) -> None:
        """Point `current` at the complete snapshot of `step` (rank 0), then drop the old ones."""
        if not self.writes:
            return
        link = os.path.join(self.root, "current")
        tmp = link + ".tmp"
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(f"step_{step}", tmp)
        os.replace(tmp, link)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)  # the switch survives a crash
        finally:
            os.close(fd)
        steps = sorted(int(m.group(1)) for m in map(STEP.match, os.listdir(self.root)) if m)
        for old in steps[:-self.keep]:
            if old != step:
                shutil.rmtree(self.folder(old), ignore_errors=True)
