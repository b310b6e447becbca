"""Learning-rate schedules (with linear warmup) and the optimizers' weight-decay groups."""
from __future__ import annotations

import math

import pytest
import torch

from models import registry
from models.tokenizer import embedded_tokenizer
from trainer.config.schema import ModelConfig, TesseraConfig
from trainer.run.optim import build_optimizer, build_scheduler, lr_factor, param_groups


@pytest.mark.parametrize("step,expected", [(0, 0.1), (4, 0.5), (9, 1.0), (10, 1.0), (57, 1.0), (99, 1.0),
                                           (500, 1.0)])
def test_constant_with_warmup(step, expected):
    assert lr_factor(step, "constant", 10, 100, 0.1) == pytest.approx(expected, abs=1e-12)


# warmup 10, total 110: 100 decay steps after warmup
@pytest.mark.parametrize("step,expected", [(0, 0.1), (9, 1.0), (10, 1.0), (35, 1 - 0.9 * 0.25), (60, 0.55),
                                           (110, 0.1), (1000, 0.1)])
def test_linear_with_warmup(step, expected):
    assert lr_factor(step, "linear", 10, 110, 0.1) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("step,expected", [(0, 0.1), (4, 0.5), (10, 1.0), (35, 0.1 + 0.45 * (1 + math.sqrt(0.5))),
                                           (60, 0.55), (85, 0.1 + 0.45 * (1 - math.sqrt(0.5))), (110, 0.1),
                                           (1000, 0.1)])
def test_cosine_with_warmup(step, expected):
    assert lr_factor(step, "cosine", 10, 110, 0.1) == pytest.approx(expected, abs=1e-12)


def test_no_warmup_starts_at_peak():
    for name in ("constant", "linear", "cosine"):
        assert lr_factor(0, name, 0, 100, 0.0) == 1.0
    assert lr_factor(50, "cosine", 0, 100, 0.0) == pytest.approx(0.5, abs=1e-12)
    assert lr_factor(50, "linear", 0, 100, 0.0) == pytest.approx(0.5, abs=1e-12)


def test_decay_is_monotone_after_warmup():
    for name in ("linear", "cosine"):
        values = [lr_factor(s, name, 5, 60, 0.2) for s in range(5, 80)]
        assert all(a >= b for a, b in zip(values, values[1:])), name
        assert values[0] == 1.0 and values[-1] == pytest.approx(0.2)


def test_unknown_schedule_raises():
    with pytest.raises(ValueError, match="scheduler.name='step'"):
        lr_factor(20, "step", 10, 100, 0.1)


def _cfg(**optim) -> TesseraConfig:
    cfg = TesseraConfig()
    for k, v in optim.items():
        setattr(cfg.optim, k, v)
    return cfg


def test_build_scheduler_follows_lr_factor():
    cfg = _cfg(lr=0.01)
    cfg.scheduler.name, cfg.scheduler.warmup_steps, cfg.scheduler.min_lr_ratio = "cosine", 4, 0.1
    cfg.train.max_steps = 20
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer(cfg, [("w", p)])
    sched = build_scheduler(cfg, opt)
    seen = []
    for step in range(25):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    expected = [0.01 * lr_factor(s, "cosine", 4, 20, 0.1) for s in range(25)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert seen[0] == pytest.approx(0.0025) and seen[4] == pytest.approx(0.01) and seen[20] == pytest.approx(0.001)


@pytest.fixture(scope="module")
def small_llama():
    m = ModelConfig(kind="llama", hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                    max_position_embeddings=32)
    return registry.build(m, registry.describe(m, embedded_tokenizer()), seed=0)


@pytest.fixture(scope="module")
def small_gpt2():
    m = ModelConfig(kind="gpt2", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=None,
                    max_position_embeddings=32)
    return registry.build(m, registry.describe(m, embedded_tokenizer()), seed=0)


@pytest.mark.parametrize("which", ["small_llama", "small_gpt2"])
def test_weight_decay_groups_exclude_1d_params(request, which):
    model = request.getfixturevalue(which)
    groups = param_groups(model.named_parameters(), 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    decay, no_decay = ({id(p) for p in g["params"]} for g in groups)
    by_name = dict(model.named_parameters())
    expected_decay = {id(p) for p in by_name.values() if p.dim() >= 2}
    expected_no = {id(p) for p in by_name.values() if p.dim() < 2}
    assert decay == expected_decay and no_decay == expected_no
    assert len(expected_no) > 0 and len(expected_decay) > 0
    names_no = {n for n, p in by_name.items() if id(p) in no_decay}
    assert all("norm" in n or "ln" in n or n.endswith("bias") for n in names_no), names_no
    assert any(n.endswith("embed_tokens.weight") or n.endswith("wte.weight")
               for n, p in by_name.items() if id(p) in decay)


def test_frozen_parameters_are_left_out():
    a, b, c = (torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2)),
               torch.nn.Parameter(torch.ones(3, 3), requires_grad=False))
    groups = param_groups([("a", a), ("b", b), ("c", c)], 0.5)
    assert [[id(p) for p in g["params"]] for g in groups] == [[id(a)], [id(b)]]
    only_vectors = param_groups([("b", b)], 0.5)
    assert len(only_vectors) == 1 and only_vectors[0]["weight_decay"] == 0.0  # empty groups are dropped


def test_adamw_decays_matrices_only():
    """With zero gradients AdamW's update is pure decoupled weight decay: matrices shrink by lr*wd, vectors stay."""
    w, g = torch.nn.Parameter(torch.full((3, 3), 2.0)), torch.nn.Parameter(torch.full((3,), 2.0))
    opt = build_optimizer(_cfg(name="adamw", lr=0.1, weight_decay=0.5, betas=[0.8, 0.9]), [("w", w), ("g", g)])
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["lr"] == 0.1
    w.grad, g.grad = torch.zeros_like(w), torch.zeros_like(g)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((3, 3), 2.0 * (1 - 0.1 * 0.5)))
    torch.testing.assert_close(g.detach(), torch.full((3,), 2.0))


def test_sgd_options():
    w = torch.nn.Parameter(torch.ones(2, 2))
    opt = build_optimizer(_cfg(name="sgd", lr=0.05, weight_decay=0.0, momentum=0.8, nesterov=True), [("w", w)])
    assert isinstance(opt, torch.optim.SGD)
    assert (opt.defaults["lr"], opt.defaults["momentum"], opt.defaults["nesterov"]) == (0.05, 0.8, True)


def test_unknown_optimizer_raises():
    with pytest.raises(ValueError, match="optim.name='lion'"):
        build_optimizer(_cfg(name="lion"), [("w", torch.nn.Parameter(torch.ones(2, 2)))])


def _kernel(opt):
    return {k: opt.defaults.get(k) for k in ("fused", "foreach")}


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_auto_takes_the_fused_kernel_on_cpu_and_the_choice_is_configurable(name):
    w = torch.nn.Parameter(torch.ones(3, 3))
    assert _kernel(build_optimizer(_cfg(name=name), [("w", w)]))["fused"] is True  # auto
    assert _kernel(build_optimizer(_cfg(name=name, implementation="for_loop"), [("w", w)])) == \
        {"fused": None, "foreach": False}
    assert _kernel(build_optimizer(_cfg(name=name, implementation="foreach"), [("w", w)]))["foreach"] is True


def test_auto_falls_back_where_a_parameter_has_no_fused_kernel():
    meta = torch.nn.Parameter(torch.ones(2, 2, device="meta"))
    opt = build_optimizer(_cfg(name="adamw"), [("w", meta)])
    assert not opt.defaults.get("fused")


def test_explicit_fused_where_no_kernel_applies_is_a_config_problem():
    from tessera.errors import ConfigError

    meta = torch.nn.Parameter(torch.ones(2, 2, device="meta"))
    with pytest.raises(ConfigError, match=r"optim.implementation='fused'.*torch.float32 on meta.*implementation=auto"):
        build_optimizer(_cfg(name="adamw", implementation="fused"), [("w", meta)])


def test_fused_and_for_loop_adamw_take_the_same_steps():
    torch.manual_seed(0)
    start = torch.randn(64, 32)
    grads = [torch.randn(64, 32) for _ in range(5)]
    finals = {}
    for impl in ("fused", "for_loop"):
        w = torch.nn.Parameter(start.clone())
        opt = build_optimizer(_cfg(name="adamw", lr=0.01, weight_decay=0.1, implementation=impl), [("w", w)])
        for g in grads:
            w.grad = g.clone()
            opt.step()
        finals[impl] = w.detach()
    moved = (finals["for_loop"] - start).abs().max().item()
    assert moved > 0.04  # five steps of lr 0.01 moved the weights
    assert (finals["fused"] - finals["for_loop"]).abs().max().item() < 1e-6 * moved * 100


def test_unknown_implementation_is_a_config_problem():
    from trainer.config.schema import validate

    cfg = _cfg(implementation="triton")
    assert any("optim.implementation='triton'" in p for p in validate(cfg, 1))
