"""trainer/parallel/expert_parallel.py: experts split over real gloo ranks (spawned processes) against one process
running every rank's inputs through the unsplit model, in fp32 within 1e-5: each rank's outputs and input
gradients, the non-expert gradients of its own loss, and its expert shards' gradients of the sum of all ranks'
losses (a local expert's gradient holds every ep rank's tokens). Tiny Mixtral and Qwen3-MoE causal LMs (2 layers,
4 experts, top-2; GPT-OSS's biased, transposed experts at ep=2), a routing forced onto experts 0 and 1 (ranks that
receive nothing, a rank with no tokens), meta-device models; `ep_problems` on configs. One spawn per world size runs
all the multi-rank checks."""
from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoModelForCausalLM, GptOssConfig, Llama4TextConfig

from tests.archs import HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, VOCAB, llama, mixtral, qwen3_moe
from trainer.parallel.dims import free_port
from trainer.parallel.expert_parallel import apply_ep, ep_problems, expert_modules


def gpt_oss():
    """Experts with biases, transposed weights and interleaved gate/up columns (the sizes of tests/archs.py)."""
    return GptOssConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                        intermediate_size=INTERMEDIATE, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=16, attention_dropout=0.0)


ARCHS = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss}
TOL = dict(rtol=1e-5, atol=1e-5)


def _config(arch: str, implementation: str):
    cfg = ARCHS[arch]()
    cfg.num_hidden_layers = 2
    cfg._experts_implementation = implementation
    return cfg


def _model(arch: str, implementation: str) -> torch.nn.Module:
    """The tiny causal LM with the same weights on every rank (vectors such as router biases included), the
    matrices of order one (fan-in scaled) so that 1e-5 is a tight tolerance."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch, implementation))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def _grads(model: torch.nn.Module) -> dict:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()}


def _expert_names(model: torch.nn.Module) -> set:
    return {f"{name}.{key}" for name, m in expert_modules(model) for key, _ in m.named_parameters(recurse=False)}


def _reference(ref, inputs, loss_of, rank: int):
    """One process, the unsplit model: rank `rank`'s output, input gradient and parameter gradients of its own
    loss, and the parameter gradients of the sum of every rank's loss."""
    total, mine = None, None
    for s, x in enumerate(inputs):
        ref.zero_grad()
        x = x.clone().requires_grad_()
        out = ref(x)
        if out.requires_grad:  # (the eager experts' output on no tokens is a constant)
            loss_of(out, s).backward()
        grads = _grads(ref)
        total = grads if total is None else {n: total[n] + g for n, g in grads.items()}
        if s == rank:
            mine = (out.detach(), torch.zeros_like(x) if x.grad is None else x.grad.clone(), grads)
    return mine, total


def _compare(ep_model, ref, inputs, loss_of, rank: int, world: int, what: str) -> None:
    (want_out, want_x_grad, want_own), want_total = _reference(ref, inputs, loss_of, rank)
    x = inputs[rank].clone().requires_grad_()
    out = ep_model(x)
    loss_of(out, rank).backward()
    torch.testing.assert_close(out, want_out, **TOL, msg=lambda m: f"{what} output: {m}")
    torch.testing.assert_close(x.grad, want_x_grad, **TOL, msg=lambda m: f"{what} input gradient: {m}")
    experts = _expert_names(ep_model)
    assert experts, what
    for name, p in ep_model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if name in experts:
            assert isinstance(p, DTensor) and isinstance(grad, DTensor) and grad.placements == (Shard(0),), name
            per_rank = p.shape[0] // world
            want = want_total[name][rank * per_rank:(rank + 1) * per_rank]
            torch.testing.assert_close(grad.to_local(), want, **TOL, msg=lambda m: f"{what} {name}: {m}")
        else:
            torch.testing.assert_close(grad, want_own[name], **TOL, msg=lambda m: f"{what} {name}: {m}")


class _OnEmbeddings(torch.nn.Module):
    """A causal LM as a function of its input embeddings (so that they have a gradient), returning its logits."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, x):
        return self.lm(inputs_embeds=x).logits


def _check_causal_lm(arch: str, implementation: str, mesh, rank: int, world: int) -> None:
    """The whole tiny LM (2 MoE layers), different inputs on every rank; the split model runs the experts with
    `implementation`, the reference with the eager loop."""
    model = _model(arch, implementation)
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    assert (expert_modules(model)[0][1].config._experts_implementation, expert_modules(ref)[0][1].config.
            _experts_implementation) == (implementation, "eager")
    names = [n for n, _ in model.named_parameters()]
    apply_ep(model, mesh)
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints keep the model's own names
    for name in sorted(_expert_names(model)):  # the model's own layout; rank r holds experts [r*E/N, (r+1)*E/N)
        assert torch.equal(model.get_parameter(name).full_tensor(), ref.get_parameter(name)), name
    inputs = [torch.randn(2, 5 + s, model.config.hidden_size, generator=torch.Generator().manual_seed(100 + s))
              for s in range(world)]
    projections = [torch.randn(2, 5 + s, model.config.vocab_size, generator=torch.Generator().manual_seed(200 + s))
                   for s in range(world)]

    def loss_of(out, s):
        return (out * projections[s]).sum() / out.shape[1]

    _compare(_OnEmbeddings(model), _OnEmbeddings(ref), inputs, loss_of, rank, world, f"{arch} ({implementation})")


def _check_forced_routing(implementation: str, mesh, rank: int, world: int) -> None:
    """Every token routed to experts 0 and 1 (router rows 2, 3 strongly negative on a positive feature): the
    ranks holding experts 2 and 3 receive nothing, and the last rank has no tokens at all."""
    block = _model("mixtral", implementation).model.layers[0].mlp
    cfg = block.experts.config
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[2:, 0] = -10.0
    ref = copy.deepcopy(block)
    ref.experts.config._experts_implementation = "eager"
    assert block.experts.config._experts_implementation == implementation
    apply_ep(block, mesh)
    inputs = []
    for s in range(world):
        x = torch.randn(2, 0 if s == world - 1 else 3 + s, cfg.hidden_size,
                        generator=torch.Generator().manual_seed(300 + s))
        x[..., 0] = x[..., 0].abs() + 1.0
        inputs.append(x)
    assert set(ref.gate(torch.cat(inputs, 1).reshape(-1, cfg.hidden_size))[2].unique().tolist()) == {0, 1}
    projections = [torch.randn(x.shape, generator=torch.Generator().manual_seed(400 + s))
                   for s, x in enumerate(inputs)]

    def loss_of(out, s):
        return (out * projections[s]).sum()

    _compare(block, ref, inputs, loss_of, rank, world, f"forced routing ({implementation})")


def _check_meta(mesh, world: int) -> None:
    """On the meta device (the trainer fills the weights later): DTensors of the full shape, E/N experts each."""
    cfg = _config("qwen3_moe", "grouped_mm")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    names = [n for n, _ in model.named_parameters()]
    apply_ep(model, mesh)
    assert [n for n, _ in model.named_parameters()] == names
    split = _expert_names(model)
    assert len(split) == 2 * cfg.num_hidden_layers
    for name, p in model.named_parameters():
        if name in split:
            assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.is_meta, name
            assert p.shape[0] == cfg.num_experts and p.to_local().shape[0] == cfg.num_experts // world, name
            assert p.shape[1:] == p.to_local().shape[1:], name
        else:
            assert not isinstance(p, DTensor), name
    model.to_empty(device="cpu")
    p = model.get_parameter(sorted(split)[0])
    assert isinstance(p, DTensor) and p.device.type == "cpu" and p.to_local().shape[0] == cfg.num_experts // world


def _worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a hang fails the test instead of stalling it
    try:
        mesh = init_device_mesh("cpu", (world,))
        _check_causal_lm("mixtral", "grouped_mm", mesh, rank, world)
        _check_causal_lm("qwen3_moe", "eager", mesh, rank, world)
        if world == 2:
            _check_causal_lm("gpt_oss", "eager", mesh, rank, world)
        _check_forced_routing("eager", mesh, rank, world)  # eager: no rows give a constant (see _local_experts)
        _check_forced_routing("grouped_mm", mesh, rank, world)
        _check_meta(mesh, world)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_split_experts_match_one_process(world):
    mp.spawn(_worker, args=(world, free_port()), nprocs=world, join=True)


def test_one_rank_is_a_no_op(one_rank_group):
    model = AutoModelForCausalLM.from_config(_config("mixtral", "grouped_mm"))
    before = dict(model.named_parameters())
    forward = model.model.layers[0].mlp.experts.forward
    apply_ep(model, init_device_mesh("cpu", (1,)))
    assert dict(model.named_parameters()) == before
    assert model.model.layers[0].mlp.experts.forward == forward


def test_ep_problems():
    assert ep_problems(llama(), 2) == ["strategy.ep=2 needs a mixture-of-experts model whose experts are fused 3-D "
                                       "tensors; llama has none"]
    assert ep_problems(mixtral(), 3) == ["strategy.ep=3 must divide the number of experts of mixtral (4); choose a "
                                         "divisor of 4"]
    assert ep_problems(mixtral(), 2) == [] and ep_problems(qwen3_moe(), 4) == [] and ep_problems(llama(), 1) == []
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(mixtral())
    assert ep_problems(built, 2) == [] and "divide" in ep_problems(built, 3)[0]
    # experts as 3-D tensors, but a forward that takes the hidden states already repeated per expert
    llama4 = Llama4TextConfig(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                              num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE, vocab_size=VOCAB,
                              num_local_experts=4)
    assert ep_problems(llama4, 2) == ["strategy.ep=2 can't split llama4_text's Llama4TextExperts: its forward does "
                                      "not take (hidden_states, top_k_index, top_k_weights) with a num_experts "
                                      "attribute"]


def test_expert_parallelism_beside_tensor_parallelism_passes_the_checks_and_beside_pipelines_is_refused(tmp_path):
    """Every check before any process group (trainer/run/build.check): ep with tp is a layout (the experts on an
    (ep, tp) mesh, tests/integration/test_expert_parallel_training.py); with pp it is refused, as is the router's
    load-balancing loss."""
    from tessera.errors import ConfigError
    from tests.archs import make_model_folder
    from tests.conftest import compose_config as compose
    from trainer.run.build import check

    model = ["model=hf", f"model.name_or_path={make_model_folder('mixtral', tmp_path / 'mixtral')}",
             "train.global_batch_size=8", "train.micro_batch_size=2"]
    dims = check(compose([*model, "strategy=fsdp_tp", "strategy.tp=2", "strategy.ep=2"]), 4)[0]
    assert (dims.dp_shard, dims.tp, dims.ep) == (2, 2, 2)
    with pytest.raises(ConfigError) as refused:
        check(compose([*model, "strategy=pp_fsdp", "strategy.pp=2", "strategy.dp_shard=2", "strategy.ep=2",
                       "model.router_aux_loss_coef=0.01"]), 4)
    problems = str(refused.value)
    assert "strategy.ep=2 with pipeline parallelism (strategy.pp=2) is not supported yet" in problems
    assert "the router's load-balancing loss (model.router_aux_loss_coef=0.01) is not available with pipeline" in \
        problems
