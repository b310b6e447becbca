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

from typing import Callable, List

import torch

from trainer.objectives.preference import NEEDS_REFERENCE, PairScores, pair_losses, sequence_logps
from trainer.run.loss import cross_entropy_sum

STAT_NAMES = ("chosen_reward", "rejected_reward", "margin", "accuracy")


class LanguageModeling:
    """objective=lm: next-token cross-entropy."""

    name = "lm"
    needs_reference = False
    rows_per_item = 1

    def loss_units(self, n_target: int, indices) -> int:
        """What a batch's loss is averaged over, from its target-token count and its items."""
        return n_target

    def loss_sum(self, logits, batch: dict, tasks=None) -> torch.Tensor:
        return cross_entropy_sum(logits, batch["labels"], tasks, batch.get("task"))

    def reset(self) -> None:
        pass

    def metrics(self, dp_sum: Callable) -> dict:
        return {}


class Preference:
    """A preference objective over pairs (two rows each: chosen, rejected)."""

    rows_per_item = 2

    def __init__(self, cfg):
        self.name, self.cfg = cfg.name, cfg
        self.needs_reference = NEEDS_REFERENCE[cfg.name]
        self.stats = None  # [chosen reward, rejected reward, margin, correct, pairs] sums since reset (device)

    def loss_units(self, n_target: int, indices) -> int:
        return len(indices)

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
        return torch.where(valid, out.losses, torch.zeros_like(out.losses)).sum()

    def _add(self, out, valid) -> None:
        chosen, rejected = out.chosen_rewards.detach().double(), out.rejected_rewards.detach().double()
        w = valid.double()
        sums = torch.stack([(chosen * w).sum(), (rejected * w).sum(), ((chosen - rejected) * w).sum(),
                            ((chosen > rejected).double() * w).sum(), w.sum()])
        self.stats = sums if self.stats is None else self.stats + sums

    def reset(self) -> None:
        self.stats = None

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
    name, kind = cfg.objective.name, cfg.data.kind
    if name == "lm":
        return [] if kind != "preference" else [
            f"data.kind=preference holds pairs for a preference objective: set objective=dpo, ipo, simpo or orpo "
            f"(objective={name} trains next-token prediction)"]
    problems = [] if kind == "preference" else [
        f"objective={name} trains on preference pairs: set data=preference with data.path (records with prompt, "
        f"chosen and rejected); data.kind={kind}"]
    refused = {"strategy.pp": dims.pp > 1, "strategy.cp": dims.cp > 1,
               "strategy.fault_tolerance=torchft": cfg.strategy.fault_tolerance != "none",
               f"sync={cfg.sync.name}": cfg.sync.name != "every_step"}
    for what, on in refused.items():
        if on:
            problems.append(f"objective={name} is not available with {what} (a pair's loss needs both responses' "
                            f"whole log-probabilities in one place); train it without")
    return problems
