"""Preference-optimisation losses (issue 34): DPO, IPO, SimPO and ORPO as pure functions of per-pair log-probabilities.

The definitions follow the papers and match TRL 1.16.0 (the peer users compare against), read in its source:
trl/trainer/dpo_trainer.py (`DPOTrainer._compute_loss`, loss types "sigmoid", "ipo", "sft"),
trl/experimental/cpo/cpo_trainer.py (`CPOTrainer.cpo_loss`, loss_type="simpo", `cpo_alpha`) and
trl/experimental/orpo/orpo_trainer.py (`ORPOTrainer.odds_ratio_loss`, `log1mexp`). Per pair, with
s = summed log-probs of a response's target tokens, n = its target-token count, m = s / n, c / r = chosen / rejected:

* dpo:   -(1-ε) logσ(β·Δ) - ε logσ(-β·Δ),  Δ = (s_c - s_c_ref) - (s_r - s_r_ref)   rewards β·(s - s_ref)
* ipo:   ((s_c - s_c_ref)/n_c - (s_r - s_r_ref)/n_r - 1/(2β))²                     rewards β·(s - s_ref)
* simpo: -(1-ε) logσ(β·(m_c - m_r) - γ) - ε logσ(-(β·(m_c - m_r) - γ))           rewards β·m
* orpo:  -m_c - β·logσ(log odds),  log odds = (m_c - m_r) - (log(1-e^m_c) - log(1-e^m_r))   rewards β·m

dpo, ipo and simpo add `sft_weight`·(-m_c) (TRL: DPO's "sft" loss type weighted by `loss_weights`, CPO's
`cpo_alpha`). Where this differs from TRL 1.16.0:

* dpo's label smoothing ε is the conservative-DPO form of the DPO authors' code and of TRL before 1.0 (and of TRL's
  CPO); TRL 1.16's "sigmoid" loss ignores `label_smoothing` (it only feeds its "robust", "exo_pair", "aot" losses).
* the SFT term is a mean over each pair's chosen tokens, the step then averages pairs; TRL takes one mean over all
  chosen tokens of the batch (the same when the chosen responses have equal lengths).
* orpo's NLL is that of the chosen response's target tokens (the paper's L_SFT, weight 1: ORPO's λ is `beta`, as in
  TRL); TRL's ORPOTrainer also counts the prompt's tokens in it. `sft_weight` is not ORPO's: it must stay 0.
* orpo's mean log-probs are clamped to <= -eps(dtype) before log(1-e^m): a response the policy reproduces with
  probability 1 (m = 0 in fp32) gives a finite log-odds and gradient where TRL's gives inf / nan.
* simpo's γ (`simpo_gamma`) is the paper's margin in reward units, as TRL's `simpo_gamma` (the SimPO authors' code
  takes γ/β instead).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

METHODS = ("dpo", "ipo", "simpo", "orpo")
NEEDS_REFERENCE = {"dpo": True, "ipo": True, "simpo": False, "orpo": False}
# methods whose logistic loss takes a label-smoothing ε (IPO's squared loss and ORPO have none)
SMOOTHED = ("dpo", "simpo")
_LOG_HALF = -0.6931471805599453  # log(1/2): where log(1-e^x) switches between its two stable forms


@dataclass(frozen=True)
class PairScores:
    """Per pair, shape [P] each: summed log-probs of each response's target tokens and the tokens' counts."""
    chosen_logps: Tensor
    rejected_logps: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor


@dataclass(frozen=True)
class PairLosses:
    losses: Tensor  # [P] the per-pair loss (what the step averages over pairs)
    chosen_rewards: Tensor  # [P] detached
    rejected_rewards: Tensor  # [P] detached


def sequence_logps(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tuple[Tensor, Tensor]:
    """(per-row sums of log p(label) over the positions whose label != ignore_index [B] fp32, their counts [B] int64).
    `labels` are already shifted: labels[:, t] is the target of logits[:, t]. One row at a time, as
    gather - logsumexp: with fp32 logits no [B, T, V] tensor is made (or kept for backward) beyond the logits."""
    targets = labels != ignore_index
    safe_labels = labels.masked_fill(~targets, 0).unsqueeze(-1)
    sums = []
    for row in range(logits.shape[0]):
        row_logits = logits[row].float()
        token_logps = row_logits.gather(-1, safe_labels[row]).squeeze(-1) - torch.logsumexp(row_logits, dim=-1)
        sums.append(torch.where(targets[row], token_logps, torch.zeros_like(token_logps)).sum())
    return torch.stack(sums), targets.sum(dim=-1)


def pair_losses(method: str, policy: PairScores, reference: Optional[PairScores], *, beta: float,
                label_smoothing: float = 0.0, sft_weight: float = 0.0, simpo_gamma: float = 0.5) -> PairLosses:
    """Per-pair losses and rewards of `method` (one of METHODS; see the module's docstring for each formula).
    `reference` is the frozen reference model's scores of the same pairs (None for simpo and orpo)."""
    _check_arguments(method, reference, beta, label_smoothing, sft_weight)
    chosen_nll = -_mean_logps(policy.chosen_logps, policy.chosen_tokens)
    if method == "dpo":
        losses, chosen_rewards, rejected_rewards = _dpo(policy, reference, beta, label_smoothing)
    elif method == "ipo":
        losses, chosen_rewards, rejected_rewards = _ipo(policy, reference, beta)
    elif method == "simpo":
        losses, chosen_rewards, rejected_rewards = _simpo(policy, beta, label_smoothing, simpo_gamma)
    else:
        losses, chosen_rewards, rejected_rewards = _orpo(policy, beta)
        return PairLosses(chosen_nll + losses, chosen_rewards.detach(), rejected_rewards.detach())
    return PairLosses(losses + sft_weight * chosen_nll, chosen_rewards.detach(), rejected_rewards.detach())


def _check_arguments(method: str, reference: Optional[PairScores], beta: float, label_smoothing: float,
                     sft_weight: float) -> None:
    if method not in NEEDS_REFERENCE:
        raise ValueError(f"unknown preference method {method!r}: expected one of {', '.join(METHODS)}")
    if NEEDS_REFERENCE[method] and reference is None:
        raise ValueError(f"preference method {method!r} needs the reference model's scores (reference=None given)")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")
    if label_smoothing and method not in SMOOTHED:
        raise ValueError(f"label_smoothing applies to {', '.join(SMOOTHED)} only, not {method!r}")
    if sft_weight < 0:
        raise ValueError(f"sft_weight must be >= 0, got {sft_weight}")
    if sft_weight and method == "orpo":
        raise ValueError("orpo's NLL term is part of the method (weight 1, its λ is beta): sft_weight must be 0")


def _mean_logps(logps: Tensor, tokens: Tensor) -> Tensor:
    # clamp: an empty response (0 target tokens) gives 0, not nan (as TRL's DPO)
    return logps / tokens.to(logps.dtype).clamp(min=1)


def _smoothed_logistic(margin: Tensor, label_smoothing: float) -> Tensor:
    """-log σ(margin) with the label flipped with probability ε (conservative DPO)."""
    return -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)


def _dpo(policy: PairScores, reference: PairScores, beta: float, label_smoothing: float):
    chosen_logratios = policy.chosen_logps - reference.chosen_logps
    rejected_logratios = policy.rejected_logps - reference.rejected_logps
    losses = _smoothed_logistic(beta * (chosen_logratios - rejected_logratios), label_smoothing)
    return losses, beta * chosen_logratios, beta * rejected_logratios


def _ipo(policy: PairScores, reference: PairScores, beta: float):
    chosen_logratios = policy.chosen_logps - reference.chosen_logps
    rejected_logratios = policy.rejected_logps - reference.rejected_logps
    # per-token log-ratios, as TRL (confirmed there with the IPO authors): β stays comparable across lengths
    margin = _mean_logps(chosen_logratios, policy.chosen_tokens) - _mean_logps(rejected_logratios,
                                                                               policy.rejected_tokens)
    return (margin - 1 / (2 * beta)) ** 2, beta * chosen_logratios, beta * rejected_logratios


def _simpo(policy: PairScores, beta: float, label_smoothing: float, gamma: float):
    chosen_mean = _mean_logps(policy.chosen_logps, policy.chosen_tokens)
    rejected_mean = _mean_logps(policy.rejected_logps, policy.rejected_tokens)
    losses = _smoothed_logistic(beta * (chosen_mean - rejected_mean) - gamma, label_smoothing)
    return losses, beta * chosen_mean, beta * rejected_mean


def _orpo(policy: PairScores, beta: float):
    """(-β log σ(log odds ratio), rewards): the odds-ratio term; the caller adds the chosen response's NLL."""
    chosen_mean = _mean_logps(policy.chosen_logps, policy.chosen_tokens)
    rejected_mean = _mean_logps(policy.rejected_logps, policy.rejected_tokens)
    log_odds = _log_odds(chosen_mean) - _log_odds(rejected_mean)
    return -beta * F.logsigmoid(log_odds), beta * chosen_mean, beta * rejected_mean


def _log_odds(mean_logps: Tensor) -> Tensor:
    """log(p / (1 - p)) for p = exp(mean_logps), with mean_logps clamped below 0 (p = 1 has infinite odds)."""
    x = mean_logps.clamp(max=-torch.finfo(mean_logps.dtype).eps)
    # log(1 - e^x): log1p(-e^x) far from 0, log(-expm1(x)) near it (no cancellation either side)
    log_one_minus_p = torch.where(x < _LOG_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
    return x - log_one_minus_p
