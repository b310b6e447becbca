"""The resume plan: `checkpoint.resume` (`auto` | `none` | a path) and `checkpoint.load_weights_only`, read once.

`intend(cfg, run_dir, restart, log)` is the one place that interprets the two keys (and a restarted launch's
override of them, trainer/launch/restarts.py); `choose(plan, ...)` then picks the checkpoint on disk and checks it
against this run before any process group starts. Both return a frozen `ResumePlan` that every consumer reads:
the run-directory claim (does this launch continue the folder's run?), the checkpoint manager (what to load,
weights only or everything, may it fall back to an older checkpoint?), the metrics logger (append to the run's
logs?). Nothing writes back into the config.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from trainer.checkpoint import manager as ckpt

NONE, AUTO, PATH = "none", "auto", "path"


@dataclass(frozen=True)
class ResumePlan:
    """What a launch resumes: `mode` (none: a new run; auto: the newest complete checkpoint of the run directory;
    path: the checkpoint `spec` names), whether only the weights are taken, and why (`reason`, for the log).
    `path` and `fallbacks` are filled by `choose` once the checkpoints on disk were checked."""

    mode: str
    spec: str  # checkpoint.resume as the user gave it
    weights_only: bool
    continues_run: bool  # this launch continues the run of its run directory (resilience/rundir.py claims it)
    reason: str = ""
    path: Optional[str] = None  # the checkpoint to load; None: start at step 0
    fallbacks: Tuple[str, ...] = ()  # mode auto: older complete checkpoints, in case `path` fails its checksums

    @property
    def falls_back(self) -> bool:
        """A damaged checkpoint is skipped for an older one (auto) rather than an error (a path)."""
        return self.mode == AUTO

    @property
    def full(self) -> bool:
        """Everything is restored (step, optimizer, schedule, data position, RNG), not only the weights."""
        return self.path is not None and not self.weights_only

    @property
    def appends_logs(self) -> bool:
        """metrics.jsonl (and eval.jsonl) continue: cut back to the resumed step rather than started anew."""
        return self.mode != NONE

    def describe(self) -> str:
        """The keys as the user would write them (messages)."""
        what = f"checkpoint.resume={self.spec}"
        return what + (" with checkpoint.load_weights_only=true" if self.weights_only else "")


def _inside(spec: str, run_dir: str) -> bool:
    path = os.path.abspath(os.path.expanduser(spec))
    run_dir = os.path.abspath(run_dir)
    return path == run_dir or path.startswith(run_dir + os.sep)


def plan_for(spec: str, weights_only: bool, run_dir: str, reason: str = "") -> ResumePlan:
    """The plan for the user's values (no restart)."""
    mode = spec if spec in (NONE, AUTO) else PATH
    continues = mode == AUTO or (mode == PATH and not weights_only and _inside(spec, run_dir))
    return ResumePlan(mode, spec, weights_only, continues, reason or f"checkpoint.resume={spec}")


def intend(cfg, run_dir: str, restart: int = 0, log: Callable[[str], None] = lambda _: None) -> ResumePlan:
    """What this launch resumes, from checkpoint.resume / checkpoint.load_weights_only and the restart count. A
    restarted launch (restart > 0) continues its run directory's run (resume=auto, fully), whatever the first
    attempt was asked to resume from, once the run has a complete checkpoint of its own (or was a new run)."""
    spec, weights_only = cfg.checkpoint.resume, cfg.checkpoint.load_weights_only
    if restart == 0:
        return plan_for(spec, weights_only, run_dir)
    own = ckpt.complete_checkpoints(os.path.join(run_dir, "checkpoints"))
    if own or spec == NONE:
        where = f"its checkpoint of step {own[-1][0]}" if own else "step 0 (no complete checkpoint yet)"
        plan = plan_for(AUTO, False, run_dir, reason=f"restart {restart}: continuing the run")
    else:
        where = f"checkpoint.resume={spec} again (no complete checkpoint of its own yet)"
        plan = plan_for(spec, weights_only, run_dir, reason=f"restart {restart}: as the first attempt")
    log(f"restart {restart}: continuing the run in {run_dir} from {where}")
    return plan


def candidates(plan: ResumePlan, run_dir: str, log: Callable[[str], None]) -> list:
    """The checkpoints the plan may load, preferred first (auto: every complete one of the run, newest first)."""
    if plan.mode == NONE:
        return []
    root = os.path.join(run_dir, "checkpoints")
    if plan.mode == AUTO:
        for partial in ckpt.partial_checkpoints(root):
            log(f"ignoring incomplete checkpoint {partial} (its save did not finish)")
        found = [path for _, path in reversed(ckpt.complete_checkpoints(root))]
        if not found:
            log("checkpoint.resume=auto: no complete checkpoint in the run directory; starting at step 0")
        return found
    path = ckpt.resolve(plan.spec, run_dir)
    return [path] if path else []


def choose(plan: ResumePlan, run_dir: str, problems_of: Callable[[str, dict], list], max_steps: int,
           log: Callable[[str], None]) -> ResumePlan:
    """The plan with the checkpoint to load (and, for auto, the older usable ones as fallbacks), each checked
    against this run before any process group starts: `problems_of(path, meta)` lists what makes it unusable."""
    found = candidates(plan, run_dir, log)
    if not found:
        return plan
    usable = []
    for path in found:
        try:
            meta = ckpt.read_meta(path)
            ckpt.verify_files(path, meta)
        except ckpt.CheckpointError as e:
            if not plan.falls_back:
                raise
            log(f"skipping checkpoint {path}: {e}")
            continue
        problems = problems_of(path, meta)
        if problems:
            raise ckpt.CheckpointError(f"cannot resume from {path}:\n" + "\n".join(f"  - {x}" for x in problems))
        if not usable and meta["step"] >= max_steps and not plan.weights_only:
            raise ckpt.CheckpointError(f"{path} is at step {meta['step']}, which already reaches "
                                       f"train.max_steps={max_steps}; raise train.max_steps to train on")
        usable.append(path)
    if not usable:
        raise ckpt.CheckpointError(f"checkpoint.resume=auto: every checkpoint in "
                                   f"{os.path.join(run_dir, 'checkpoints')} is damaged (see above); start over "
                                   f"with checkpoint.resume=none and checkpoint.overwrite=true")
    return dataclasses.replace(plan, path=usable[0], fallbacks=tuple(usable[1:]))
