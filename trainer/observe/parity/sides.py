"""The two runs of a parity check from the command line: each side's overrides (the --against side starts from the
first side's), launcher and process count, composed and checked before anything is launched: both compose, they are
comparable (same seed, data, global batch) and they differ in something."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from omegaconf import OmegaConf

from tessera.errors import TesseraError
from trainer.config.compose import compose_job
from trainer.launch.choose import launcher_for
from trainer.run.cli import COMPOSE_ERRORS, compose_message

LAUNCHERS = ("python", "torchrun", "deepspeed")
# Keys both sides must share: the sequence of global batches depends only on these (docs/architecture.md), so two
# runs that differ here are not the same training and their difference says nothing about the layouts.
SHARED = ("train.seed", "train.global_batch_size", "data")


class ParityError(TesseraError):
    """A parity command line that cannot run (exit 2): overrides that do not compose, sides that are not
    comparable or are the same run, a bad option."""


def forced(steps: int) -> List[str]:
    """Appended to each side's overrides (the last override of a key wins): N steps, every one logged, and nothing
    else that costs time (no evaluation, export, snapshot or checkpoint, no resume of an earlier run)."""
    return [f"train.max_steps={steps}", "train.log_every=1", "eval.every=0", "eval.at_start=false",
            "eval.at_end=false", "export.hf_at_end=false", "export.snapshot_every=0", "checkpoint.every=0",
            "checkpoint.at_end=false", "checkpoint.resume=none", "logging.progress=false"]


@dataclass
class Side:
    label: str  # "A" (the reference) or "B" (--against)
    overrides: List[str]  # the user's, inherited ones first (shown in the report)
    launcher: str  # python, torchrun or deepspeed
    nproc: int
    precision: str = "fp32"
    extra: List[str] = field(default_factory=list)  # the parity command's own (forced(), a shrunk model)
    against: Optional[List[str]] = None  # side B: its own overrides, shown after side A's (which it starts from)

    def argv(self, run_dir: str) -> List[str]:
        return list(self.overrides) + list(self.extra) + [f"hydra.run.dir={run_dir}"]

    def describe(self) -> str:
        shown = ("side A's + " + (" ".join(self.against) or "nothing") if self.against is not None
                 else " ".join(self.overrides) or "(defaults)")
        return f"{self.launcher} x{self.nproc}, {self.precision}: {shown}"


def default_nproc(launcher: str) -> int:
    """launch.sh's rule: one process for python; else NPROC_PER_NODE, else every local GPU, else 2 (CPU)."""
    if launcher == "python":
        return 1
    if os.environ.get("NPROC_PER_NODE", "").isdigit():
        return int(os.environ["NPROC_PER_NODE"])
    import torch  # start-up time: only where a process count must be guessed

    return torch.cuda.device_count() or 2


def make_side(label: str, overrides: List[str], launcher, nproc, steps: int) -> Tuple[Side, dict]:
    """A side, composed and checked (composed()), with its launcher (trainer/launch/choose.py's choice for the
    strategy unless given) and process count, and its resolved config; a combination that cannot run is a
    ParityError naming the side and the option."""
    cfg = composed(label, overrides, steps)
    chosen = launcher or launcher_for(overrides)
    if chosen not in LAUNCHERS:
        raise ParityError(f"side {label}: the parity check runs on one machine with python, torchrun or deepspeed, "
                          f"not {chosen} (torchft replica groups: compare one replica group's run instead)")
    count = default_nproc(chosen) if nproc is None else nproc
    if count < 1:
        raise ParityError(f"side {label}: the process count must be at least 1, not {count}")
    if chosen == "python" and count != 1:
        raise ParityError(f"side {label}: the python launcher starts one process, not {count}; pass a strategy "
                          f"with a process group (strategy=ddp, ...) or --launcher torchrun")
    return Side(label, list(overrides), chosen, count, precision=str(cfg["precision"]["name"])), cfg


def composed(label: str, overrides: List[str], steps: int) -> dict:
    """The side's resolved config as a plain dict (Hydra's own node left out); a problem is a ParityError naming
    the side."""
    try:
        cfg = compose_job(list(overrides) + forced(steps))
    except COMPOSE_ERRORS as e:
        raise ParityError(f"side {label} ({' '.join(overrides) or 'defaults'}): {compose_message(e)}") from None
    out = OmegaConf.to_container(cfg, resolve=False)
    out.pop("hydra", None)
    return out


def _get(cfg: dict, dotted: str):
    for part in dotted.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
    return cfg


def check_pair(a: Side, b: Side, cfg_a: dict, cfg_b: dict) -> None:
    """The two sides train the same batches, and are not the same run."""
    differ = [key for key in SHARED if _get(cfg_a, key) != _get(cfg_b, key)]
    if differ:
        raise ParityError(f"the two sides differ in {', '.join(differ)}: they would not train on the same global "
                          f"batches; compare layouts (strategy=...), launchers, world sizes or precisions instead")
    if cfg_a == cfg_b and (a.launcher, a.nproc) == (b.launcher, b.nproc):
        raise ParityError("the two sides are the same run (same config, launcher and process count); give "
                          "--against a different strategy=, precision=, --against-launcher or --against-nproc")
