"""The preference-optimisation losses (trainer/objectives/preference.py, issue 34) against closed forms written out
by hand and against TRL's own loss code on the same numbers (TRL is what users compare with)."""
from __future__ import annotations

import math
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from trainer.objectives.preference import NEEDS_REFERENCE, PairScores, pair_losses, sequence_logps

with warnings.catch_warnings():  # TRLExperimentalWarning: CPO and ORPO live in trl.experimental
    warnings.simplefilter("ignore")
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer
    from trl.trainer.dpo_trainer import DPOTrainer

# three pairs: policy / reference summed log-probs of the chosen (c) and rejected (r) responses, their token counts
CHOSEN, REJECTED = [-12.0, -30.5, -7.25], [-15.0, -28.0, -20.0]
REF_CHOSEN, REF_REJECTED = [-13.0, -29.0, -8.0], [-14.0, -29.5, -18.5]
CHOSEN_TOKENS, REJECTED_TOKENS = [4, 10, 3], [5, 8, 9]
CPU = SimpleNamespace(device=torch.device("cpu"))  # the accelerator TRL's loss code asks for a device


def _scores(chosen, rejected, dtype=torch.float64) -> PairScores:
    return PairScores(torch.tensor(chosen, dtype=dtype), torch.tensor(rejected, dtype=dtype),
                      torch.tensor(CHOSEN_TOKENS), torch.tensor(REJECTED_TOKENS))


POLICY, REFERENCE = _scores(CHOSEN, REJECTED), _scores(REF_CHOSEN, REF_REJECTED)


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _assert_values(result, losses, chosen_rewards, rejected_rewards, tol=1e-6):
    for got, want in ((result.losses, losses), (result.chosen_rewards, chosen_rewards),
                      (result.rejected_rewards, rejected_rewards)):
        assert got.tolist() == pytest.approx(want, abs=tol)


# --- closed forms -----------------------------------------------------------------------------------------------

def test_dpo_closed_form():
    beta, eps, sft = 0.3, 0.1, 0.7
    losses, chosen_rewards, rejected_rewards = [], [], []
    for i in range(3):
        chosen_ratio, rejected_ratio = CHOSEN[i] - REF_CHOSEN[i], REJECTED[i] - REF_REJECTED[i]
        margin = beta * (chosen_ratio - rejected_ratio)
        nll = -CHOSEN[i] / CHOSEN_TOKENS[i]
        losses.append(-(1 - eps) * _log_sigmoid(margin) - eps * _log_sigmoid(-margin) + sft * nll)
        chosen_rewards.append(beta * chosen_ratio)
        rejected_rewards.append(beta * rejected_ratio)
    result = pair_losses("dpo", POLICY, REFERENCE, beta=beta, label_smoothing=eps, sft_weight=sft)
    _assert_values(result, losses, chosen_rewards, rejected_rewards)


def test_ipo_closed_form():
    beta, sft = 0.4, 0.2
    losses, chosen_rewards, rejected_rewards = [], [], []
    for i in range(3):
        chosen_ratio, rejected_ratio = CHOSEN[i] - REF_CHOSEN[i], REJECTED[i] - REF_REJECTED[i]
        margin = chosen_ratio / CHOSEN_TOKENS[i] - rejected_ratio / REJECTED_TOKENS[i]
        losses.append((margin - 1 / (2 * beta)) ** 2 + sft * -CHOSEN[i] / CHOSEN_TOKENS[i])
        chosen_rewards.append(beta * chosen_ratio)
        rejected_rewards.append(beta * rejected_ratio)
    result = pair_losses("ipo", POLICY, REFERENCE, beta=beta, sft_weight=sft)
    _assert_values(result, losses, chosen_rewards, rejected_rewards)


def test_simpo_closed_form():
    beta, gamma, eps, sft = 2.0, 1.2, 0.05, 0.3
    losses, chosen_rewards, rejected_rewards = [], [], []
    for i in range(3):
        chosen_mean, rejected_mean = CHOSEN[i] / CHOSEN_TOKENS[i], REJECTED[i] / REJECTED_TOKENS[i]
        margin = beta * chosen_mean - beta * rejected_mean - gamma
        losses.append(-(1 - eps) * _log_sigmoid(margin) - eps * _log_sigmoid(-margin) + sft * -chosen_mean)
        chosen_rewards.append(beta * chosen_mean)
        rejected_rewards.append(beta * rejected_mean)
    result = pair_losses("simpo", POLICY, None, beta=beta, label_smoothing=eps, sft_weight=sft, simpo_gamma=gamma)
    _assert_values(result, losses, chosen_rewards, rejected_rewards)


def test_orpo_closed_form():
    beta = 0.25
    losses, chosen_rewards, rejected_rewards = [], [], []
    for i in range(3):
        chosen_mean, rejected_mean = CHOSEN[i] / CHOSEN_TOKENS[i], REJECTED[i] / REJECTED_TOKENS[i]
        chosen_odds = math.exp(chosen_mean) / (1 - math.exp(chosen_mean))
        rejected_odds = math.exp(rejected_mean) / (1 - math.exp(rejected_mean))
        log_odds_ratio = math.log(chosen_odds / rejected_odds)
        losses.append(-chosen_mean - beta * math.log(1 / (1 + math.exp(-log_odds_ratio))))
        chosen_rewards.append(beta * chosen_mean)
        rejected_rewards.append(beta * rejected_mean)
    result = pair_losses("orpo", POLICY, None, beta=beta)
    _assert_values(result, losses, chosen_rewards, rejected_rewards)


# --- TRL --------------------------------------------------------------------------------------------------------

class _TokenLogps:
    """Stands for the model in DPOTrainer._compute_loss: per-token log-probs that sum to the given sequence
    log-probs (spread evenly over the completion's tokens, 0 elsewhere as for TRL's labels of -100)."""
    training = False

    def __init__(self, per_token_logps):
        self.per_token_logps = per_token_logps

    def __call__(self, **kwargs):
        zeros = torch.zeros_like(self.per_token_logps)
        return SimpleNamespace(log_probs=self.per_token_logps, entropy=zeros, mean_logits=zeros,
                               is_top1=zeros.bool())


def _trl_dpo_one_pair(i, loss_types, loss_weights, beta, label_smoothing=0.0):
    """(loss, chosen reward, rejected reward) of TRL's DPO on pair i alone, through its real loss code
    (DPOTrainer._compute_loss) with precomputed reference log-probs: no model, no accelerator, stubs with the
    attributes the code reads."""
    lengths = (CHOSEN_TOKENS[i], REJECTED_TOKENS[i])
    width = 1 + max(lengths)  # one prompt token, then the completion, then padding
    completion_mask = torch.zeros(2, width, dtype=torch.long)
    per_token = torch.zeros(2, width - 1, dtype=torch.float64)
    for row, (logps, n) in enumerate(zip((CHOSEN[i], REJECTED[i]), lengths)):
        completion_mask[row, 1:1 + n] = 1
        per_token[row, :n] = logps / n
    model = _TokenLogps(per_token)
    trainer = SimpleNamespace(
        model=model, accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t,
                                                 gather_for_metrics=lambda t: t),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=loss_types, loss_weights=loss_weights, beta=beta, label_smoothing=label_smoothing,
        use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.ones(2, width, dtype=torch.long), "attention_mask": torch.ones(2, width),
              "completion_mask": completion_mask,
              "ref_chosen_logps": torch.tensor([REF_CHOSEN[i]], dtype=torch.float64),
              "ref_rejected_logps": torch.tensor([REF_REJECTED[i]], dtype=torch.float64)}
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    metrics = trainer._metrics["eval"]
    return float(loss), metrics["rewards/chosen"][-1], metrics["rewards/rejected"][-1]


def _assert_matches_trl_pairs(result, trl_pairs):
    losses, chosen_rewards, rejected_rewards = (list(column) for column in zip(*trl_pairs))
    _assert_values(result, losses, chosen_rewards, rejected_rewards)


@pytest.mark.parametrize("label_smoothing, sft_weight", [(0.0, 0.0), (0.1, 0.7)])
def test_dpo_matches_trl(label_smoothing, sft_weight):
    beta = 0.3
    loss_types, weights = ["sigmoid", "sft"], [1.0, sft_weight]
    if label_smoothing:  # TRL 1.16's "sigmoid" ignores ε; conservative DPO is 2(1-ε)·sigmoid - (1-2ε)·robust
        loss_types = ["sigmoid", "robust", "sft"]
        weights = [2 * (1 - label_smoothing), -(1 - 2 * label_smoothing), sft_weight]
    trl_pairs = [_trl_dpo_one_pair(i, loss_types, weights, beta, label_smoothing) for i in range(3)]
    result = pair_losses("dpo", POLICY, REFERENCE, beta=beta, label_smoothing=label_smoothing, sft_weight=sft_weight)
    _assert_matches_trl_pairs(result, trl_pairs)


@pytest.mark.parametrize("sft_weight", [0.0, 0.2])
def test_ipo_matches_trl(sft_weight):
    beta = 0.4
    trl_pairs = [_trl_dpo_one_pair(i, ["ipo", "sft"], [1.0, sft_weight], beta) for i in range(3)]
    _assert_matches_trl_pairs(pair_losses("ipo", POLICY, REFERENCE, beta=beta, sft_weight=sft_weight), trl_pairs)


def _mean_logps(chosen, rejected):
    """Per-token mean log-probs of the chosen and rejected responses (fp64)."""
    return (torch.tensor(chosen, dtype=torch.float64) / torch.tensor(CHOSEN_TOKENS),
            torch.tensor(rejected, dtype=torch.float64) / torch.tensor(REJECTED_TOKENS))


@pytest.mark.parametrize("label_smoothing, sft_weight", [(0.0, 0.0), (0.05, 0.3)])
def test_simpo_matches_trl(label_smoothing, sft_weight):
    beta, gamma = 2.0, 1.2
    chosen_mean, rejected_mean = _mean_logps(CHOSEN, REJECTED)  # TRL's CPO averages log-probs for simpo
    cpo = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=label_smoothing,
                          accelerator=CPU)
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(cpo, chosen_mean, rejected_mean)
    # TRL's loss adds cpo_alpha x the chosen tokens' mean cross-entropy (get_batch_loss_metrics)
    losses = losses + sft_weight * -chosen_mean
    result = pair_losses("simpo", POLICY, None, beta=beta, label_smoothing=label_smoothing, sft_weight=sft_weight,
                         simpo_gamma=gamma)
    _assert_values(result, losses.tolist(), chosen_rewards.tolist(), rejected_rewards.tolist())


def test_orpo_matches_trl():
    beta = 0.25
    chosen_mean, rejected_mean = _mean_logps(CHOSEN, REJECTED)  # TRL's ORPO averages log-probs
    orpo = SimpleNamespace(beta=beta, accelerator=CPU)
    odds_terms, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(orpo, chosen_mean, rejected_mean)
    # TRL's loss is the chosen NLL minus beta * log sigmoid(log odds ratio) (get_batch_loss_metrics)
    losses = -chosen_mean - odds_terms.double()
    result = pair_losses("orpo", POLICY, None, beta=beta)
    _assert_values(result, losses.tolist(), chosen_rewards.tolist(), rejected_rewards.tolist())


# --- numerics ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", sorted(NEEDS_REFERENCE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_kept_and_rewards_detached(method, dtype):
    policy = _scores(CHOSEN, REJECTED, dtype)
    policy = PairScores(policy.chosen_logps.requires_grad_(), policy.rejected_logps.requires_grad_(),
                        policy.chosen_tokens, policy.rejected_tokens)
    reference = _scores(REF_CHOSEN, REF_REJECTED, dtype) if NEEDS_REFERENCE[method] else None
    result = pair_losses(method, policy, reference, beta=0.5)
    assert {result.losses.dtype, result.chosen_rewards.dtype, result.rejected_rewards.dtype} == {dtype}
    assert result.losses.shape == (3,) and result.losses.requires_grad
    assert not result.chosen_rewards.requires_grad and not result.rejected_rewards.requires_grad


def test_orpo_finite_when_a_response_has_probability_one():
    # fp32 log-softmax rounds a very confident token's log-prob to exactly 0: log(1 - p) = -inf in TRL's ORPO
    logps = torch.tensor([0.0, -3.0], requires_grad=True)
    policy = PairScores(logps[:1], logps[1:], torch.tensor([2]), torch.tensor([2]))
    reversed_policy = PairScores(logps[1:], logps[:1], torch.tensor([2]), torch.tensor([2]))
    total = pair_losses("orpo", policy, None, beta=0.1).losses + pair_losses("orpo", reversed_policy, None,
                                                                              beta=0.1).losses
    total.sum().backward()
    assert torch.isfinite(total).all() and torch.isfinite(logps.grad).all()


def test_extreme_margins_stay_finite():
    policy = PairScores(torch.tensor([-1.0, -5000.0]), torch.tensor([-5000.0, -1.0]), torch.tensor([1, 1]),
                        torch.tensor([1, 1]))
    reference = PairScores(torch.zeros(2), torch.zeros(2), torch.tensor([1, 1]), torch.tensor([1, 1]))
    for method in ("dpo", "simpo"):
        losses = pair_losses(method, policy, reference, beta=1.0, label_smoothing=0.1).losses
        assert torch.isfinite(losses).all(), method


# --- sequence_logps ---------------------------------------------------------------------------------------------

def _direct_logps(logits, labels):
    sums, counts = [], []
    log_probs = F.log_softmax(logits.float(), dim=-1)
    for row in range(labels.shape[0]):
        positions = [t for t in range(labels.shape[1]) if labels[row, t] != -100]
        sums.append(sum(float(log_probs[row, t, labels[row, t]]) for t in positions))
        counts.append(len(positions))
    return sums, counts


def _logits_and_labels():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=generator) * 4
    labels = torch.randint(0, 11, (3, 6), generator=generator)
    labels[0, :2] = -100  # prompt positions
    labels[1, 4:] = -100  # padding
    labels[2, :] = -100  # a row with no target
    return logits, labels


def test_sequence_logps_matches_a_direct_computation():
    logits, labels = _logits_and_labels()
    logits.requires_grad_()
    sums, counts = sequence_logps(logits, labels)
    want_sums, want_counts = _direct_logps(logits.detach(), labels)
    assert sums.dtype == torch.float32 and counts.tolist() == want_counts == [4, 4, 0]
    assert sums.tolist() == pytest.approx(want_sums, abs=1e-5)
    # TRL's own per-sequence log-probs (CPO's get_batch_logps; is_encoder_decoder: labels already shifted)
    trl_sums = CPOTrainer.get_batch_logps(logits.detach(), labels.clone(), is_encoder_decoder=True)
    assert sums.tolist() == pytest.approx(trl_sums.tolist(), abs=1e-5)
    sums.sum().backward()
    reference_logits = logits.detach().clone().requires_grad_()
    F.log_softmax(reference_logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).mul(
        labels != -100).sum().backward()
    torch.testing.assert_close(logits.grad, reference_logits.grad)


def test_sequence_logps_computes_bf16_logits_in_fp32():
    logits, labels = _logits_and_labels()
    bf16_logits = logits.bfloat16()
    sums, counts = sequence_logps(bf16_logits, labels)
    want_sums, _ = _direct_logps(bf16_logits.float(), labels)  # the same bf16 values, in fp32
    assert sums.dtype == torch.float32
    assert sums.tolist() == pytest.approx(want_sums, abs=1e-5)


def test_sequence_logps_custom_ignore_index():
    logits, labels = _logits_and_labels()
    relabelled = labels.masked_fill(labels == -100, -1)
    assert sequence_logps(logits, relabelled, ignore_index=-1)[0].tolist() == sequence_logps(logits, labels)[0].tolist()


# --- errors -----------------------------------------------------------------------------------------------------

def test_unknown_method_lists_the_methods():
    with pytest.raises(ValueError, match="unknown preference method 'kto'.*dpo, ipo, simpo, orpo"):
        pair_losses("kto", POLICY, REFERENCE, beta=0.1)


@pytest.mark.parametrize("method", ["dpo", "ipo"])
def test_missing_reference(method):
    with pytest.raises(ValueError, match=f"{method}.*needs the reference model"):
        pair_losses(method, POLICY, None, beta=0.1)


@pytest.mark.parametrize("method, options, message", [
    ("orpo", {"sft_weight": 0.5}, "sft_weight must be 0"),
    ("ipo", {"label_smoothing": 0.1}, "label_smoothing applies to dpo, simpo only"),
    ("dpo", {"label_smoothing": 0.5}, r"label_smoothing must lie in \[0, 0.5\)"),
    ("dpo", {"beta": 0.0}, "beta must be > 0"),
    ("simpo", {"sft_weight": -1.0}, "sft_weight must be >= 0"),
])
def test_arguments_a_method_does_not_take(method, options, message):
    with pytest.raises(ValueError, match=message):
        pair_losses(method, POLICY, REFERENCE, **{"beta": 0.1, **options})
