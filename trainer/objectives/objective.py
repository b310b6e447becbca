"""What a run trains (the objective= group): the loss of a micro-batch's logits, what the step's loss is averaged
over, and the objective's own metrics. The strategies call `loss_sum` where they took the token cross-entropy; the
loop asks `loss_units` for the step's divisor. Nothing here knows the layout.

- `LanguageModeling` (objective=lm): the sum of next-token cross-entropies over the target tokens, averaged over the
  global batch's target tokens.
- `Preference` (objective=dpo|ipo|simpo|orpo, data=preference): batches hold each pair as two rows (chosen,
  rejected); the rows' response log-probabilities (trainer/objectives/preference.py `sequence_logps`) and, for DPO
  and IPO, the reference model's (scored once before training: trainer/objectives/reference.py) give each pair's
  loss, averaged over the global batch's pairs. Metrics: the mean chosen and rejected rewards, their margin and
  the share of pairs whose chosen reward is the higher (accuracy).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from trainer.data.preference import holds_pairs
from trainer.objectives.preference import NEEDS_REFERENCE, PairScores, pair_losses, sequence_logps
from trainer.run.loss import cross_entropy_sum

STAT_NAMES = ("chosen_reward", "rejected_reward", "margin", "accuracy")
TASK_SUMS = ("loss", *STAT_NAMES, "pairs")  # a mixture's per-task sums


class LanguageModeling:
    """objective=lm: next-token cross-entropy."""

    name = "lm"
    needs_reference = False
    rows_per_item = 1

    def loss_units(self, n_target: int, indices) -> int:
        """What a batch's loss is averaged over, from its target-token count and its items."""
        return n_target

    def prepare(self, batch: dict) -> dict:
        """The micro-batch as the loss needs it, before the model's forward."""
        return batch

    def loss_sum(self, logits, batch: dict, tasks=None) -> torch.Tensor:
        return cross_entropy_sum(logits, batch["labels"], tasks, batch.get("task"))

    def track_tasks(self, num_tasks: int, device) -> None:
        """data.kind=mixture: the strategies keep each task's token-loss sums (TaskLosses)."""

    def reset(self) -> None:
        pass

    def metrics(self, dp_sum: Callable) -> dict:
        return {}

    def task_metrics(self, dp_sum: Callable) -> Optional[list]:
        """Per-task figures of the objective's own (None: the token losses the strategies keep per task)."""
        return None


class Preference:
    """A preference objective over pairs (two rows each: chosen, rejected)."""

    rows_per_item = 2

    def __init__(self, cfg):
        self.name, self.cfg = cfg.name, cfg
        self.needs_reference = NEEDS_REFERENCE[cfg.name]
        self.stats = None  # [chosen reward, rejected reward, margin, correct, pairs] sums since reset (device)
        self.live_reference = None  # objective.reference=on_the_fly: trainer/objectives/reference.LiveReference
        self.num_tasks = 0  # data.kind=mixture: its preference sources
        self.task_stats = None  # [task, TASK_SUMS] sums since reset (device)

    def use_reference(self, live_reference) -> None:
        """Score each micro-batch's pairs with `live_reference` (else the batches carry the offline scores)."""
        self.live_reference = live_reference

    def loss_units(self, n_target: int, indices) -> int:
        return len(indices)

    def prepare(self, batch: dict) -> dict:
        """With a live reference: its scores of the batch's pairs, before the policy's forward (which a reference
        sharing the policy's modules, LoRA's base with adapters off, must not run between forward and backward)."""
        if self.live_reference is None:
            return batch
        return {**batch, "reference_logps": self.live_reference.logps(batch)}

    def loss_sum(self, logits, batch: dict, tasks=None) -> torch.Tensor:
        """The sum of the micro-batch's pair losses (pairs without targets, an evaluation's fillers, count 0)."""
        logps, tokens = sequence_logps(logits, batch["labels"])
        valid = (tokens[0::2] > 0) & (tokens[1::2] > 0)
        tokens = tokens.clamp(min=1).to(logps.dtype)
        policy = PairScores(logps[0::2], logps[1::2], tokens[0::2], tokens[1::2])
        reference = None
        if self.needs_reference:
            ref = batch["reference_logps"].to(logps.dtype)
            reference = PairScores(ref[0::2], ref[1::2], tokens[0::2], tokens[1::2])
        c = self.cfg
        out = pair_losses(c.name, policy, reference, beta=c.beta, label_smoothing=c.label_smoothing,
                          sft_weight=c.sft_weight, simpo_gamma=c.simpo_gamma)
        self._add(out, valid)
        if self.num_tasks and batch.get("task") is not None:
            self._add_tasks(out, valid, batch["task"])
        return torch.where(valid, out.losses, torch.zeros_like(out.losses)).sum()

    def _add(self, out, valid) -> None:
        chosen, rejected = out.chosen_rewards.detach().double(), out.rejected_rewards.detach().double()
        w = valid.double()
        sums = torch.stack([(chosen * w).sum(), (rejected * w).sum(), ((chosen - rejected) * w).sum(),
                            ((chosen > rejected).double() * w).sum(), w.sum()])
        self.stats = sums if self.stats is None else self.stats + sums

    def _add_tasks(self, out, valid, task) -> None:
        chosen, rejected = out.chosen_rewards.detach().double(), out.rejected_rewards.detach().double()
        w = valid.double()
        rows = torch.stack([out.losses.detach().double(), chosen, rejected, chosen - rejected,
                            (chosen > rejected).double(), torch.ones_like(w)], 1) * w[:, None]
        self.task_stats.index_add_(0, task.to(rows.device), rows)

    def track_tasks(self, num_tasks: int, device) -> None:
        """data.kind=mixture: keep each task's pair losses, rewards and accuracy (each pair carries its task)."""
        self.num_tasks, self.device = num_tasks, device
        self.reset()

    def reset(self) -> None:
        self.stats = None
        if self.num_tasks:
            self.task_stats = torch.zeros(self.num_tasks, len(TASK_SUMS), dtype=torch.float64, device=self.device)

    def task_metrics(self, dp_sum: Callable) -> Optional[list]:
        """Per task since reset() over every data-parallel rank: the mean pair loss, the pairs, the mean rewards,
        margin and accuracy (None where a task had no pair); None without tasks."""
        if not self.num_tasks:
            return None
        out = []
        for row in dp_sum(self.task_stats).tolist():
            pairs = row[-1]
            figures = {name: value / pairs if pairs else None for name, value in zip(("loss", *STAT_NAMES), row)}
            out.append({"loss": figures.pop("loss"), "pairs": int(pairs), **figures})
        return out

    def metrics(self, dp_sum: Callable) -> dict:
        """The mean rewards, margin and accuracy of the pairs since reset() over every data-parallel rank."""
        if self.stats is None:
            return {}
        totals = dp_sum(self.stats).tolist()
        pairs = max(totals[-1], 1.0)
        return {name: value / pairs for name, value in zip(STAT_NAMES, totals[:-1])}


def build_objective(cfg):
    """The objective of `cfg.objective`."""
    return LanguageModeling() if cfg.objective.name == "lm" else Preference(cfg.objective)


def objective_problems(cfg, dims) -> List[str]:
    """The objective's checks before any process group starts: objective and data agree, and the layout serves
    a preference loss."""
    name, kind, pairs = cfg.objective.name, cfg.data.kind, holds_pairs(cfg.data)
    what = "data.kind=preference holds" if kind == "preference" else "the mixture's preference sources hold"
    if name == "lm":
        return [] if not pairs else [
            f"{what} pairs for a preference objective: set objective=dpo, ipo, simpo or orpo "
            f"(objective={name} trains next-token prediction)"]
    problems = [] if pairs else [
        f"objective={name} trains on preference pairs: set data=preference with data.path (records with prompt, "
        f"chosen and rejected); data.kind={kind}"]
    refused = {"strategy.pp": dims.pp > 1, "strategy.cp": dims.cp > 1,
               "strategy.fault_tolerance=torchft": cfg.strategy.fault_tolerance != "none",
               f"sync={cfg.sync.name}": cfg.sync.name != "every_step"}
    for what, on in refused.items():
        if on:
            problems.append(f"objective={name} is not available with {what} (a pair's loss needs both responses' "
                            f"whole log-probabilities in one place); train it without")
    return problems + _reference_problems(cfg)


def _reference_problems(cfg) -> List[str]:
    """objective.reference=on_the_fly: for an objective with a reference, from the starting model itself."""
    o = cfg.objective
    if o.reference != "on_the_fly":
        return []
    if not NEEDS_REFERENCE.get(o.name, False):
        return [f"objective.reference=on_the_fly: objective={o.name} has no reference model; leave "
                f"objective.reference=offline"]
    if cfg.peft.name != "none" and cfg.peft.adapter:
        return [f"objective.reference=on_the_fly with peft.adapter: the reference is the base with that adapter, "
                f"while the live reference of a LoRA run is its base with the adapters off; set "
                f"objective.reference=offline (scored once with the adapter)"]
    return []
