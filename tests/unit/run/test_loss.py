"""The step loss is token-normalized over the whole global batch (sum of token CEs / number of targets), never a
mean of per-micro-batch means. Exercised through SingleStrategy.forward_backward, the loop's real code path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import registry
from trainer.config.schema import ModelConfig, TesseraConfig
from trainer.data.datasets import IGNORE
from trainer.run.optim import build_optimizer
from trainer.parallel.dims import ParallelDims
from trainer.run.precision import Precision
from trainer.run.loss import token_loss_sum
from trainer.strategies.single import SingleStrategy

L = 16  # sequence length


@pytest.fixture(scope="module")
def setup():
    cfg = TesseraConfig()
    cfg.strategy.name = "single"
    cfg.model = ModelConfig(kind="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=128, max_position_embeddings=64)
    tokenizer = registry.load_tokenizer(cfg.model)
    info = registry.describe(cfg.model, tokenizer)
    model = registry.build(cfg.model, info, seed=0)
    device = torch.device("cpu")
    strategy = SingleStrategy(cfg, ParallelDims(1, 1, 1, 1, 1), device, Precision(cfg, device))
    strategy.setup(model, lambda named: build_optimizer(cfg, named))
    return strategy, info.vocab_size


def _micro_batches(model, vocab):
    """Two micro-batches with very unequal target counts: A has 3 'easy' targets (the model's own argmax), B has
    27 'hard' ones (its argmin), so their per-token losses differ clearly."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, L), generator=g)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    labels = torch.full((4, L), IGNORE, dtype=torch.long)
    easy, hard = logits.argmax(-1), logits[..., :256].argmin(-1)
    labels[0, [3, 9]] = easy[0, [3, 9]]
    labels[1, [15]] = easy[1, [15]]
    labels[2, 2:16] = hard[2, 2:16]  # 14
    labels[3, 0:13] = hard[3, 0:13]  # 13
    a = {"input_ids": ids[:2].clone(), "labels": labels[:2].clone()}
    b = {"input_ids": ids[2:].clone(), "labels": labels[2:].clone()}
    return a, b


def _num_targets(batch):
    return int((batch["labels"] != IGNORE).sum())


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model, a, b):
    """One forward/backward over the concatenated batch, mean over its targets."""
    model.zero_grad(set_to_none=True)
    ids = torch.cat([a["input_ids"], b["input_ids"]])
    labels = torch.cat([a["labels"], b["labels"]])
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def test_micro_batches_have_unequal_target_counts(setup):
    strategy, vocab = setup
    a, b = _micro_batches(strategy.model, vocab)
    assert (_num_targets(a), _num_targets(b)) == (3, 27)


def test_token_loss_sum_is_the_sum_over_labelled_positions(setup):
    strategy, vocab = setup
    a, _ = _micro_batches(strategy.model, vocab)
    with torch.no_grad():
        got = token_loss_sum(strategy.model, a, strategy.precision).item()
        logp = strategy.model(input_ids=a["input_ids"]).logits.log_softmax(-1)
    mask = a["labels"] != IGNORE
    expected = -logp[mask].gather(-1, a["labels"][mask].unsqueeze(-1)).sum().item()
    assert got == pytest.approx(expected, rel=1e-6)


def test_forward_backward_is_token_normalized(setup):
    strategy, vocab = setup
    model = strategy.model
    a, b = _micro_batches(model, vocab)
    n = _num_targets(a) + _num_targets(b)
    ref_loss, ref_grads = _reference(model, a, b)

    model.zero_grad(set_to_none=True)
    ce_sum = strategy.forward_backward([a, b], n)
    grads = _grads(model)
    model.zero_grad(set_to_none=True)

    assert ce_sum.requires_grad is False
    assert abs(ce_sum.item() / n - ref_loss) < 1e-6
    assert set(grads) == set(ref_grads) and len(grads) > 0
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_mean_of_means_would_be_measurably_wrong(setup):
    """The counterexample: averaging per-micro-batch means weights A's 3 tokens like B's 27."""
    strategy, vocab = setup
    model = strategy.model
    a, b = _micro_batches(model, vocab)
    ref_loss, ref_grads = _reference(model, a, b)

    model.zero_grad(set_to_none=True)
    means = []
    for mb in (a, b):
        mean = token_loss_sum(model, mb, strategy.precision) / _num_targets(mb)
        (mean / 2).backward()
        means.append(mean.item())
    mm_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    assert means[1] - means[0] > 0.5  # easy vs hard targets
    mean_of_means = sum(means) / 2
    assert abs(mean_of_means - ref_loss) > 0.1, (mean_of_means, ref_loss)
    diff = torch.sqrt(sum(((mm_grads[k] - ref_grads[k]) ** 2).sum() for k in ref_grads))
    norm = torch.sqrt(sum((g ** 2).sum() for g in ref_grads.values()))
    assert diff / norm > 0.05, float(diff / norm)


@pytest.mark.parametrize("split", [[4], [1, 3], [2, 2], [1, 1, 1, 1]])
def test_gradient_independent_of_micro_batch_split(setup, split):
    strategy, vocab = setup
    model = strategy.model
    a, b = _micro_batches(model, vocab)
    ids = torch.cat([a["input_ids"], b["input_ids"]])
    labels = torch.cat([a["labels"], b["labels"]])
    ref_loss, ref_grads = _reference(model, a, b)

    micro, start = [], 0
    for size in split:
        micro.append({"input_ids": ids[start:start + size], "labels": labels[start:start + size]})
        start += size
    model.zero_grad(set_to_none=True)
    ce_sum = strategy.forward_backward(micro, 30)
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    assert abs(ce_sum.item() / 30 - ref_loss) < 1e-6
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_optimizer_step_clips_and_zeroes(setup):
    strategy, vocab = setup
    model = strategy.model
    a, b = _micro_batches(model, vocab)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        strategy.forward_backward([a, b], 30)
        expected_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
        norm, skipped = strategy.optimizer_step(max_norm=1e-3)
        assert skipped is False
        assert float(norm) == pytest.approx(float(expected_norm), rel=1e-5)  # norm before clipping
        assert all(p.grad is None for p in model.parameters())
        assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    finally:
        with torch.no_grad():  # later tests use the same weights
            for n, p in model.named_parameters():
                p.copy_(before[n])
        strategy.optimizer.state.clear()
