"""The router's load-balancing loss (trainer/run/router_loss.py) against transformers' own: Tessera's micro-batch
loss with the term equals the model's loss with labels and output_router_logits, for the two MoE architectures of
the matrix; which coefficient applies; its checks. (It counts once on every layout, against one process:
tests/integration/test_expert_parallel_training.py.)"""
from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.archs import make_config
from trainer.data.datasets import IGNORE
from trainer.run.loss import micro_batch_losses, token_loss_sum
from trainer.run.router_loss import RouterBalance, aux_loss_coef, router_loss_problems

NO_AUTOCAST = SimpleNamespace(autocast=nullcontext)


def _model(name, **config):
    torch.manual_seed(0)
    hf_config = make_config(name)
    for key, value in config.items():
        setattr(hf_config, key, value)
    return AutoModelForCausalLM.from_config(hf_config).float()


def _batch(vocab):
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    return ids, {"input_ids": ids, "labels": torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE)], 1)}


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_the_term_is_transformers_load_balancing_loss(name):
    model = _model(name)
    ids, batch = _batch(model.config.vocab_size)
    router = RouterBalance(0.25, model.config)
    router.attach(model)
    ce_sum, term = micro_batch_losses(model, batch, NO_AUTOCAST, router=router)
    theirs = model(input_ids=ids, labels=ids, output_router_logits=True)
    n_targets = int((batch["labels"] != IGNORE).sum())
    assert float(term.detach()) == pytest.approx(float(theirs.aux_loss), rel=1e-6)
    model.router_aux_loss_coef = 0.25
    theirs = model(input_ids=ids, labels=ids, output_router_logits=True)
    assert float(ce_sum / n_targets + 0.25 * term.detach()) == pytest.approx(float(theirs.loss), rel=1e-6)
    term.backward()  # the term reaches the routers' weights
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "gate" in n)
    assert router.count == 1 and float(router.sum) == pytest.approx(float(term))


def test_the_routers_are_captured_only_in_a_training_forward():
    """Not outside micro_batch_losses, and not under no_grad (an activation-checkpointing recompute runs with
    grad enabled but outside the capture, an evaluation under no_grad)."""
    model = _model("mixtral")
    _, batch = _batch(model.config.vocab_size)
    router = RouterBalance(0.1, model.config)
    router.attach(model)
    with router.capturing() as seen, torch.no_grad():
        model(input_ids=batch["input_ids"])
    assert seen == []
    with router.capturing() as seen:
        model(input_ids=batch["input_ids"])
    assert len(seen) == model.config.num_hidden_layers and seen[0].shape == (32, model.config.num_local_experts)
    model(input_ids=batch["input_ids"])  # outside: nothing kept
    assert router._captured is None


def test_a_model_config_asking_for_router_logits_computes_no_loss_of_its_own():
    """output_router_logits=true in the model's config: Tessera's term uses the config's coefficient, and the
    model is asked for no router logits (it would compute its own aux loss, which under tensor parallelism fails
    on the routers' DTensors)."""
    model = _model("mixtral", output_router_logits=True, router_aux_loss_coef=0.02)
    _, batch = _batch(model.config.vocab_size)
    cfg = SimpleNamespace(router_aux_loss_coef=None)
    assert aux_loss_coef(cfg, model.config) == 0.02
    router = RouterBalance(aux_loss_coef(cfg, model.config), model.config)
    assert router.forward_kwargs == {"output_router_logits": False}
    calls = []
    model.register_forward_hook(lambda m, a, kw, out: calls.append(out.aux_loss), with_kwargs=True)
    token_loss_sum(model, batch, NO_AUTOCAST, router=router)
    assert calls == [None]
    assert aux_loss_coef(SimpleNamespace(router_aux_loss_coef=0.0), model.config) == 0.0
    model.config.output_router_logits = False
    assert aux_loss_coef(cfg, model.config) == 0.0  # off unless the config asks for router logits


def test_checks_before_any_process_group():
    def problems(name, coef, pp=1):
        cfg = SimpleNamespace(model=SimpleNamespace(router_aux_loss_coef=coef))
        return router_loss_problems(cfg, make_config(name), SimpleNamespace(pp=pp))

    assert problems("mixtral", 0.01) == [] and problems("llama", None) == [] and problems("llama", 0.0) == []
    assert "has no top-k router" in problems("llama", 0.01)[0]
    assert problems("mixtral", -1.0) == []  # the config's range check says it (trainer/config/schema.py RANGES)
    assert "not available with pipeline parallelism (strategy.pp=2)" in problems("qwen3_moe", 0.01, pp=2)[0]
