"""optim.name=adafactor, muon and adamw_8bit beside adamw and sgd: each trains, keeps the state bytes the planner
counts, checkpoints as tensors and resumes exactly; Muon's split between its two parts; which layouts each runs on
(the refusals name the key and where it runs); a resumed run re-applies only the values each group takes."""
from __future__ import annotations

import copy

import pytest
import torch

from models import plans, registry
from models.tokenizer import embedded_tokenizer
from tests.conftest import compose_config
from trainer.checkpoint import resume_policy
from trainer.checkpoint.saved import groups_by_name
from trainer.config.schema import ModelConfig
from trainer.parallel.dims import ParallelDims
from trainer.run.muon import MuonWithAdamW
from trainer.run.optim import OPTIMIZERS, build_optimizer, build_scheduler, optimizer_problems, state_bytes
from trainer.strategies import strategy_class
from trainer.strategies.capabilities import DTENSORS, FLAT_PARTITIONS, TENSORS

NEW = ("adafactor", "muon", "adamw_8bit")


def _model():
    # hidden 64: the 64 x 64 projections reach bitsandbytes' 4096 elements (8-bit moments), the norms do not
    m = ModelConfig(kind="llama", hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
                    max_position_embeddings=32)
    return registry.build(m, registry.describe(m, embedded_tokenizer()), seed=0)


def _optimizer(name: str, model, **optim):
    cfg = compose_config([f"optim={name}", *(f"optim.{k}={v}" for k, v in optim.items())])
    return cfg, build_optimizer(cfg, model.named_parameters(), plans.embedding_weight_names(model))


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 200, (4, 16), generator=g) for _ in range(n)]


def _train(model, opt, batches):
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _state_bytes_held(opt) -> int:
    seen, total = set(), 0
    for state in opt.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.numel() * value.element_size()
    return total


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_trains_and_holds_the_state_bytes_the_planner_counts(name):
    model = _model()
    cfg, opt = _optimizer(name, model)
    batches = _batches(1) * 8  # one batch again and again: every optimizer must fit it
    losses = _train(model, opt, batches)
    assert losses[-1] < losses[0] - 0.3, losses
    embeddings = plans.embedding_weight_names(model)
    counted = sum(state_bytes(name, tuple(p.shape), n in embeddings, cfg.optim.momentum)
                  for n, p in model.named_parameters())
    shared_maps = 2 * 256 * 4 if name == "adamw_8bit" else 0  # bitsandbytes' quantization maps, once
    assert _state_bytes_held(opt) == counted + shared_maps


def test_the_new_optimizers_are_not_adamw():
    """Each takes steps of its own from the same start; 8-bit AdamW's are AdamW's within its quantization error
    (measured: 1.3% of AdamW's movement in L2; Adafactor 97%, Muon 76%)."""
    start = torch.cat([p.detach().flatten() for p in _model().parameters()])
    finals = {}
    for name in ("adamw",) + NEW:
        model = _model()
        _train(model, _optimizer(name, model)[1], _batches(4))
        finals[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
    moved = (finals["adamw"] - start).norm()
    gap = {name: ((finals[name] - finals["adamw"]).norm() / moved).item() for name in NEW}
    assert gap["adafactor"] > 0.3 and gap["muon"] > 0.3 and 1e-4 < gap["adamw_8bit"] < 0.05, gap


def test_adamw_8bit_quantizes_the_moments_of_large_tensors_and_checkpoints_tensors_only():
    model = _model()
    _, opt = _optimizer("adamw_8bit", model)
    _train(model, opt, _batches(2))
    by_name = dict(model.named_parameters())
    proj, norm = by_name["model.layers.0.self_attn.q_proj.weight"], by_name["model.layers.0.input_layernorm.weight"]
    assert opt.state[proj]["state1"].dtype == torch.uint8 and opt.state[proj]["absmax1"].numel() == 4096 // 256
    assert opt.state[norm]["state1"].dtype == torch.float32
    assert float(opt.state[proj]["step"]) == 2.0

    def leaves(tree):
        return [x for v in tree.values() for x in (leaves(v) if isinstance(v, dict) else [v])]

    assert all(torch.is_tensor(v) for v in leaves(opt.state_dict()["state"]))  # no pickled Python objects


@pytest.mark.parametrize("name", NEW)
def test_a_restored_optimizer_takes_the_same_steps(name):
    """state_dict -> a fresh optimizer -> load_state_dict: the next steps are bit-identical (what a resume does)."""
    torch.manual_seed(0)
    first, second = _model(), _model()
    _, opt = _optimizer(name, first)
    batches = _batches(5)
    _train(first, opt, batches[:3])
    second.load_state_dict(first.state_dict())
    _, restored = _optimizer(name, second)
    restored.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load keeps the tensors it is given
    assert _train(first, opt, batches[3:]) == _train(second, restored, batches[3:])
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)


def test_muon_steps_the_hidden_matrices_and_leaves_the_rest_to_adamw():
    model = _model()
    _, opt = _optimizer("muon", model)
    assert isinstance(opt, MuonWithAdamW)
    muon, adamw = opt.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert "model.embed_tokens.weight" in in_adamw and "lm_head.weight" in in_adamw
    assert all(p.dim() == 2 for n, p in model.named_parameters() if n in in_muon)
    assert in_muon == {n for n, p in model.named_parameters() if p.dim() == 2} - {"model.embed_tokens.weight",
                                                                                   "lm_head.weight"}
    assert in_muon | in_adamw == set(names.values()) and not in_muon & in_adamw
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"


def test_muon_one_schedule_drives_both_parts_also_after_a_restore():
    model = _model()
    cfg, opt = _optimizer("muon", model)
    cfg.scheduler.warmup_steps, cfg.train.max_steps = 4, 10
    sched = build_scheduler(cfg, opt)
    _train(model, opt, _batches(1))
    sched.step()
    opt.load_state_dict(opt.state_dict())  # load_state_dict replaces the groups: the parts must follow
    sched.step()
    lrs = [g["lr"] for part in opt.parts for g in part.param_groups]
    assert lrs == [g["lr"] for g in opt.param_groups] and lrs == pytest.approx([cfg.optim.lr * 3 / 4] * len(lrs))
    assert all(part.state is opt.state for part in opt.parts)


@pytest.mark.parametrize("name,parameters,refused", [
    ("adafactor", FLAT_PARTITIONS, "factors each matrix's second moment"),
    ("adafactor", DTENSORS, "no DTensor rules"),
    ("muon", FLAT_PARTITIONS, "orthogonalises each matrix's update"),
    ("adamw_8bit", DTENSORS, "bitsandbytes' 8-bit kernels have no DTensor rules"),
])
def test_an_optimizer_a_layout_cannot_step_is_refused_naming_where_it_runs(name, parameters, refused):
    strategy = "zero2" if parameters == FLAT_PARTITIONS else "fsdp"
    (problem,) = optimizer_problems(compose_config([f"optim={name}", f"strategy={strategy}"]), parameters)
    assert problem.startswith(f"optim.name={name}: ") and refused in problem, problem
    assert f"strategy={strategy}" in problem and problem.endswith("or optim.name=adamw"), problem


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_what_each_optimizer_runs_on(name):
    runs = {"adamw": {TENSORS, DTENSORS, FLAT_PARTITIONS}, "sgd": {TENSORS, DTENSORS, FLAT_PARTITIONS},
            "adafactor": {TENSORS}, "muon": {TENSORS, DTENSORS}, "adamw_8bit": {TENSORS, FLAT_PARTITIONS}}
    cfg = compose_config([f"optim={name}"])
    assert {form for form in (TENSORS, DTENSORS, FLAT_PARTITIONS) if not optimizer_problems(cfg, form)} == runs[name]


@pytest.mark.parametrize("overrides,world,expected", [
    (["strategy=single"], 1, TENSORS), (["strategy=ddp"], 2, TENSORS), (["strategy=zero1"], 2, FLAT_PARTITIONS),
    (["strategy=zero3"], 2, FLAT_PARTITIONS), (["strategy=fsdp"], 1, DTENSORS), (["strategy=fsdp"], 2, DTENSORS),
    (["strategy=tp"], 2, DTENSORS), (["strategy=pp"], 2, TENSORS), (["strategy=pp_fsdp"], 4, DTENSORS),
    (["strategy=fsdp", "strategy.cp=2"], 2, DTENSORS),
])
def test_each_layout_says_what_its_optimizer_steps(overrides, world, expected):
    cfg = compose_config(overrides)
    dims = ParallelDims.from_config(cfg.strategy, world)
    assert strategy_class(cfg.strategy.name).optimizer_parameters(cfg, dims) == expected


@pytest.mark.parametrize("name,implementation,ok", [
    ("adafactor", "foreach", True), ("adafactor", "fused", False), ("adamw_8bit", "foreach", False),
    ("muon", "fused", True), ("muon", "for_loop", True),
])
def test_optim_implementation_is_checked_against_the_optimizer_kernels(name, implementation, ok):
    cfg = compose_config([f"optim={name}", f"optim.implementation={implementation}"])
    problems = optimizer_problems(cfg, TENSORS)
    assert not problems if ok else problems == [
        f"optim.implementation={implementation}: optim.name={name} has no such kernel (its kernels: "
        f"{'foreach, for_loop' if name == 'adafactor' else 'none but its own'}); use optim.implementation=auto"]


def test_fused_muon_on_dtensors_is_its_adamw_part_and_allowed():
    cfg = compose_config(["optim=muon", "optim.implementation=fused", "strategy=fsdp"])
    assert optimizer_problems(cfg, DTENSORS) == []
    cfg = compose_config(["optim=sgd", "optim.implementation=fused", "strategy=fsdp"])
    assert "no fused sgd kernel" in optimizer_problems(cfg, DTENSORS)[0]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_resumed_run_applies_its_values_to_the_groups_that_take_them(tmp_path, name):
    """A changed optim.weight_decay reaches the decayed groups (Muon's and its AdamW's matrices), betas / eps only
    the groups that use optim.betas / optim.eps (Muon's Newton-Schulz eps and Adafactor's are their own)."""
    model = _model()
    cfg, opt = _optimizer(name, model)
    before = [dict(g) for g in opt.param_groups]
    cfg.optim.weight_decay, cfg.optim.eps, cfg.optim.betas, cfg.optim.momentum = 0.3, 1e-6, [0.8, 0.9], 0.5
    resume_policy.apply(str(tmp_path), cfg, opt, build_scheduler(cfg, opt), 0)
    for old, group in zip(before, opt.param_groups):
        assert group["weight_decay"] == (0.3 if old["decays"] else 0.0)
        if "betas" in old:
            assert (group["betas"], group["eps"]) == ((0.8, 0.9), 1e-6)
        elif "eps" in old:  # Muon's, Adafactor's
            assert group["eps"] == old["eps"]
        if "momentum" in old:
            assert group["momentum"] == 0.5


def test_pipeline_stages_match_saved_groups_of_the_same_optimizer():
    """A stage whose parameters rank 0 did not save finds the group of the same optimizer that decays as it does."""
    saved = [{"params": ["a"], "weight_decay": 0.1, "decays": True, "ns_steps": 5, "lr": 1.0},
             {"params": ["b"], "weight_decay": 0.1, "decays": True, "betas": [0.9, 0.95], "lr": 2.0},
             {"params": ["c"], "weight_decay": 0.0, "decays": False, "betas": [0.9, 0.95], "lr": 3.0}]
    mine = [{"params": ["x"], "weight_decay": 0.1, "decays": True, "betas": [0.9, 0.95], "lr": 0.0},
            {"params": ["y"], "weight_decay": 0.1, "decays": True, "ns_steps": 5, "lr": 0.0}]
    assert [g["lr"] for g in groups_by_name(saved, mine)] == [2.0, 1.0]
    older = [{k: v for k, v in g.items() if k != "decays"} for g in saved]  # saved before groups said so
    assert [g["lr"] for g in groups_by_name(older, mine)] == [2.0, 1.0]
