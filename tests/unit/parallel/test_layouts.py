"""The torch-native layouts' building blocks without launching a run: the optimizer kernel chosen per parameter
type (DTensor parameters and torch's fused SGD), the fp64 gradient norm, per-layer attention settings on a
pipeline stage, derived pipeline splits, and tensor-parallel plan refusals reported before any process group."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from tests.conftest import compose_config
from tessera.errors import ConfigError


def _dtensor_params(n=3):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    return [torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])) for _ in range(n)]


def test_torch_still_has_no_fused_sgd_for_dtensors_but_fused_adamw(one_rank_group):
    """The table DTENSOR_FUSED follows torch: if this starts failing, torch gained a fused SGD for DTensors and
    'sgd' can join the table."""
    from trainer.run.optim import DTENSOR_FUSED

    params = _dtensor_params()
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(NotImplementedError, match="_fused_sgd"):
        torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True).step()
    torch.optim.AdamW(params, lr=0.1, fused=True).step()
    assert DTENSOR_FUSED == {"adamw"}


def _sharded_params(n=2):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])) for _ in range(n)]
    for p in params:
        p.grad = distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])
    return params


def test_torch_adafactor_and_bitsandbytes_still_cannot_step_dtensors_and_muon_can(one_rank_group):
    """The refusals of trainer/run/optim.py STEPPING follow the libraries: if one of the first two starts passing,
    its optimizer can run on FSDP / tensor-parallel layouts and the refusal should go."""
    import bitsandbytes

    with pytest.raises(RuntimeError, match="aten.pow_"):
        torch.optim.Adafactor(_sharded_params(), lr=0.01).step()
    with pytest.raises(NotImplementedError, match="bitsandbytes.*sharding strategy"):
        bitsandbytes.optim.AdamW8bit(_sharded_params(), lr=0.01).step()
    params = _sharded_params()
    whole = [torch.nn.Parameter(p.full_tensor().clone()) for p in params]
    for p, w in zip(params, whole):
        w.grad = p.grad.full_tensor().clone()
    torch.optim.Muon(params, lr=0.01).step()
    torch.optim.Muon(whole, lr=0.01).step()
    for p, w in zip(params, whole):
        torch.testing.assert_close(p.full_tensor(), w.detach())


@pytest.mark.parametrize("name,expected", [("sgd", {"foreach": True}), ("adamw", {"fused": True})])
def test_auto_picks_the_kernel_per_parameter_type(one_rank_group, name, expected):
    """auto: fused wherever the kernel takes the parameters; DTensor SGD steps with foreach, and trains."""
    from trainer.run.optim import build_optimizer

    cfg = compose_config([f"optim={name}"])
    params = _dtensor_params()
    opt = build_optimizer(cfg, [(f"p{i}", p) for i, p in enumerate(params)])
    chosen = opt.defaults
    if "fused" in expected:
        assert chosen["fused"] is True
    else:
        assert not chosen.get("fused") and chosen.get("foreach") in (None, True)
    before = [p.detach().full_tensor().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, params))


def test_explicit_fused_sgd_on_a_dtensor_strategy_is_a_config_problem():
    from trainer.run.build import check

    with pytest.raises(ConfigError) as e:
        check(compose_config(["optim=sgd", "optim.implementation=fused", "strategy=fsdp"]), 2)
    assert any("optim.implementation=fused" in p and "sgd" in p and "auto" in p for p in e.value.problems)
    check(compose_config(["optim=adamw", "optim.implementation=fused", "strategy=fsdp"]), 2)  # no problem


def test_gradient_square_sum_is_accumulated_in_fp64():
    """A large embedding-like gradient: the fp64 sum matches an fp64 recomputation to 1e-12, where a plain fp32
    sum of squares is measurably off."""
    from trainer.parallel.grad_norm import grad_square_sum

    torch.manual_seed(0)
    grads = [torch.randn(50_000, 64) * 1e-3, torch.randn(64), torch.randn(300, 300)]
    exact = sum(float(g.double().pow(2).sum()) for g in grads)
    got = grad_square_sum(grads)
    assert got.dtype == torch.float64
    assert abs(float(got) - exact) / exact < 1e-12
    naive = sum(float(g.pow(2).sum(dtype=torch.float32)) for g in [g.float() for g in grads])
    assert naive != exact  # fp32 accumulation is not exact at this size


def test_gradient_square_sum_of_dtensors(one_rank_group):
    from trainer.parallel.grad_norm import world_square_sum

    params = _dtensor_params()
    exact = sum(float(p.detach().full_tensor().double().pow(2).sum()) for p in params)
    got = world_square_sum([p.detach() for p in params], torch.device("cpu"))
    assert abs(float(got) - exact) < 1e-9 * exact


def _meta(model_type, **kw):
    from transformers import AutoConfig

    from models.init import meta_model

    base = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=320, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return meta_model(AutoConfig.for_model(model_type, **base))


def test_a_pipeline_stage_keeps_each_blocks_global_attention_type():
    """The base model runs `config.layer_types[i]` for its i-th block: a later stage's base model sees the types
    of its own (global) layers; the causal LM's config stays the full model's."""
    from models import plans
    from trainer.parallel.pipeline import cut_stage

    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    model = _meta("qwen3", layer_types=types, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    split = plans.pipeline_split(model)
    cut_stage(model, split, first=False, last=True, layers=range(2, 4))
    assert list(model.model.layers._modules) == ["2", "3"]
    assert model.model.config.layer_types == types[2:]
    assert model.config.layer_types == types and model.model.config is not model.config
    assert model.model.embed_tokens is None


@pytest.mark.parametrize("model_type,layers,first,last,zeroed", [
    ("gpt_neox", "gpt_neox.layers", ["gpt_neox.embed_in"], ["gpt_neox.final_layer_norm", "lm_head"], []),
    ("opt", "model.decoder.layers", ["model.decoder.embed_tokens", "model.decoder.embed_positions"],
     ["model.decoder.final_layer_norm", "lm_head"], ["model.decoder.embed_positions"]),
    ("qwen2", "model.layers", ["model.embed_tokens"], ["model.norm", "lm_head"], []),
])
def test_pipeline_splits_are_derived_from_the_decoder_layer_list(model_type, layers, first, last, zeroed):
    from models import plans

    extra = dict(ffn_dim=128, word_embed_proj_dim=64) if model_type == "opt" else {}
    split = plans.pipeline_split(_meta(model_type, **extra))
    assert (split.layers, split.first, split.last, split.zeroed_on_later_stages) == (layers, first, last, zeroed)


@pytest.mark.parametrize("model_type,layers,extra", [
    ("gpt2", "transformer.h", {}),
    ("mixtral", "model.layers", {}),  # the experts' lists inside each block are not the blocks
    ("jamba", "model.layers", {}),  # two block classes (attention, mamba) in one list
])
def test_decoder_blocks_are_the_items_of_the_largest_module_list(model_type, layers, extra):
    from models.init import decoder_blocks

    model = _meta(model_type, **extra)
    blocks = decoder_blocks(model)
    assert [name for name, _ in blocks] == [f"{layers}.{i}" for i in range(model.config.num_hidden_layers)]
    assert all(block is model.get_submodule(name) for name, block in blocks)
    assert decoder_blocks(torch.nn.Linear(2, 2)) == []


def _info(model):
    from types import SimpleNamespace

    c = model.config
    heads = getattr(c, "num_attention_heads", None)
    return SimpleNamespace(num_heads=heads, num_kv_heads=getattr(c, "num_key_value_heads", None) or heads)


def test_tp_plan_styles_of_transformers_are_accepted_and_unknown_ones_refused():
    from models import plans

    qwen3 = _meta("qwen3")
    assert plans.tp_plan_problems(qwen3, _info(qwen3), 2) == []
    assert "replicated_with_grad_allreduce" in plans.tp_plan(qwen3, 2).values()
    opt = _meta("opt", ffn_dim=128, word_embed_proj_dim=64)
    text = "\n".join(plans.tp_plan_problems(opt, _info(opt), 2))
    assert "opt architecture has no tensor-parallel plan" in text and "strategy.tp=1" in text
    model = _meta("llama")
    model.config.base_model_tp_plan = {"layers.*.mlp.gate_proj": "exotic_style"}
    text = "\n".join(plans.tp_plan_problems(model, _info(model), 2))
    assert "'exotic_style'" in text and "strategy.tp=1" in text


def test_a_plan_under_another_base_model_name_still_splits_the_blocks_and_one_that_splits_none_is_refused():
    """Llama 4's causal LM names `language_model` as its base model and holds `model`: its plan is placed where the
    blocks are (before, no pattern matched and tp held whole blocks on every rank). gpt-oss's plan names only the
    embeddings: refused before any group starts, as one that splits nothing inside the blocks."""
    from models import plans

    llama4 = _meta("llama4_text", intermediate_size_mlp=128, num_local_experts=2, interleave_moe_layer_step=2)
    resolved = plans.resolve_plan(llama4, plans.tp_plan(llama4, 2))
    assert resolved["model.layers.0.self_attn.q_proj"] == "colwise"
    assert resolved["model.layers.1.feed_forward.shared_expert.down_proj"] == "rowwise"
    assert resolved["model.layers.1.feed_forward.experts"] == "moe_tp_experts"
    assert plans.tp_plan_problems(llama4, _info(llama4), 2) == []
    gpt_oss = _meta("gpt_oss", num_local_experts=2)
    text = "\n".join(plans.tp_plan_problems(gpt_oss, _info(gpt_oss), 2))
    assert "splits nothing inside the decoder blocks" in text and "strategy.tp=1" in text


def test_a_module_with_parameters_of_its_own_beside_its_childrens_runs_under_tp(one_rank_group):
    """An attention module holding a parameter of its own (sinks) beside its projections: the parameters the plan
    leaves whole become replicated DTensors, and the module's forward mixes its own with its children's plain
    outputs on local tensors (before: 'got mixed torch.Tensor and DTensor'); tuple outputs come back plain."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from trainer.parallel.tensor_parallel import _replicate_the_rest

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.sinks = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.proj(x) + self.sinks

    class Router(torch.nn.Linear):
        def forward(self, x):
            logits = super().forward(x)
            return logits.softmax(-1), logits

    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(Attention(), Router(4, 4))
    x, weights = torch.randn(3, 4), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    expected = reference[1](reference[0](x))[0]
    (expected * weights).sum().backward()
    _replicate_the_rest(model, init_device_mesh("cpu", (1,)))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    scores, logits = model[1](model[0](x))
    assert not isinstance(scores, DTensor) and not isinstance(logits, DTensor)
    assert torch.allclose(scores, expected)
    (scores * weights).sum().backward()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(p.grad, DTensor) and torch.allclose(p.grad.to_local(), ref.grad), name


def test_tied_embeddings_are_detected_and_kept_whole_under_tp():
    from models import plans

    gpt2 = _meta("gpt2", n_embd=64, n_layer=2, n_head=4)
    assert plans.ties_embeddings(gpt2)
    llama = _meta("llama", tie_word_embeddings=True)
    plan = plans.tp_plan(llama, 2)
    assert plans.ties_embeddings(llama) and "model.embed_tokens" not in plan and "lm_head" not in plan
    assert not plans.ties_embeddings(_meta("llama"))


def test_strategies_checkpoint_every_kth_block_in_their_setup():
    """Activation checkpointing is applied by the strategy's setup (after tensor parallelism, before any wrapper):
    every 2nd decoder block of the model the strategy trains has Hugging Face's checkpointing switched on."""
    import torch

    from models import registry
    from models.init import decoder_blocks
    from models.tokenizer import embedded_tokenizer
    from trainer.run.optim import build_optimizer
    from trainer.parallel.dims import ParallelDims
    from trainer.run.precision import Precision
    from trainer.strategies.single import SingleStrategy

    cfg = compose_config(["model.hidden_size=64", "model.num_layers=4", "model.num_heads=4",
                          "train.activation_checkpointing=full", "train.activation_checkpointing_every=2"])
    info = registry.describe(cfg.model, embedded_tokenizer())
    model = registry.build(cfg.model, info, seed=0)
    assert not any(getattr(b, "gradient_checkpointing", False) for _, b in decoder_blocks(model))
    dims = ParallelDims.from_config(cfg.strategy if cfg.strategy.name == "single" else compose_config(
        ["strategy=single"]).strategy, 1)
    strategy = SingleStrategy(cfg, dims, torch.device("cpu"), Precision(cfg, torch.device("cpu")))
    strategy.setup(model, lambda named: build_optimizer(cfg, named))
    flags = [bool(getattr(b, "gradient_checkpointing", False)) for _, b in decoder_blocks(strategy.unwrapped())]
    assert flags == [True, False, True, False], flags


def _stages(model_type, **kw):
    """A real (seeded) tiny model and its two pipeline stages (layers 0-1, 2-3) over deep copies of it."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from models import plans
    from trainer.parallel.pipeline import StageModule, cut_stage

    base = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=320, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    attention = kw.pop("attn_implementation", "sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**base, **kw}),
                                             attn_implementation=attention).eval()
    split = plans.pipeline_split(model)
    stages = []
    for first, layers in ((True, range(0, 2)), (False, range(2, 4))):
        part = copy.deepcopy(model)
        cut_stage(part, split, first=first, last=not first, layers=layers)
        stages.append(StageModule(part, first, not first))
    return model, stages


# Architectures whose forward does something to the embeddings before the first block, or after the last one, that
# is not a module of its own (Granite's embedding multiplier and logit scaling, Gemma's normalizer), a norm of the
# embeddings (Bloom), learned positions (GPT-2, OPT), Llama 4 (its base model is not `language_model`).
CHAINED = {
    "llama": {},
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=4.0),
    "bloom": dict(attn_implementation="eager", tie_word_embeddings=False),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, attn_implementation="eager", tie_word_embeddings=False),
    "gpt2": dict(tie_word_embeddings=False),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64, tie_word_embeddings=False),
    "llama4_text": dict(head_dim=16, intermediate_size_mlp=128, num_local_experts=2, interleave_moe_layer_step=2),
}


@pytest.mark.parametrize("model_type", list(CHAINED))
def test_pipeline_stages_chained_are_the_whole_model(model_type):
    """The stages' logits are the whole model's: a later stage's first block takes the received hidden states as
    they came (not multiplied or normalized again by the model's forward), an earlier stage hands out its last
    block's output; gradients reach every stage's parameters as the whole model's do (untied embeddings: tied
    ones are two weights on two stages, summed by the strategy)."""
    model, (first, last) = _stages(model_type, **CHAINED[model_type])
    ids = torch.randint(3, 320, (2, 16), generator=torch.Generator().manual_seed(2))
    whole = model(input_ids=ids, use_cache=False).logits
    staged = last(first(ids))
    assert torch.allclose(staged, whole, atol=1e-5), (staged - whole).abs().max()
    whole.square().mean().backward()
    staged.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for stage in (first, last):
        for name, p in stage.lm.named_parameters():
            assert torch.allclose(p.grad, grads[name], atol=1e-5), name


def test_pipeline_split_puts_a_norm_of_the_embeddings_on_the_first_stage():
    from models import plans

    split = plans.pipeline_split(_meta("bloom", n_layer=4, n_head=4))
    assert split.first == ["transformer.word_embeddings", "transformer.word_embeddings_layernorm"]
    assert split.last == ["transformer.ln_f", "lm_head"]


def test_a_module_the_split_puts_at_the_wrong_end_stops_the_stage():
    """A split that takes a module running before the blocks for a final one (as Tessera's took Bloom's norm of the
    embeddings) would skip it on the first stage and compute another model: the stage's placeholder for it sees
    that the model called it before any block and says so."""
    import copy

    from models import plans
    from tessera.errors import ModelError
    from trainer.parallel.pipeline import StageModule, cut_stage

    model, _ = _stages("bloom", attn_implementation="eager")
    split = plans.pipeline_split(model)
    wrong = plans.PipelineSplit(split.layers, ["transformer.word_embeddings"],
                                ["transformer.word_embeddings_layernorm", *split.last])
    part = copy.deepcopy(model)
    cut_stage(part, wrong, first=True, last=False, layers=range(0, 2))
    with pytest.raises(ModelError, match="runs transformer.word_embeddings_layernorm before its decoder blocks"):
        StageModule(part, True, False)(torch.randint(3, 320, (1, 8)))


def test_a_later_stage_hands_its_first_block_the_received_states_also_by_keyword():
    """A base model that calls its blocks with `hidden_states=`: the later stage's first block gets the received
    hidden states by that keyword (its forward's own scaling of the embeddings is not applied again); a block
    called with neither is stopped with a message."""
    from types import SimpleNamespace

    from tessera.errors import ModelError
    from trainer.parallel.pipeline import StageModule

    class Block(torch.nn.Linear):
        def forward(self, hidden_states=None, other=None):
            return super().forward(hidden_states if other is None else other)

    class Body(torch.nn.Module):
        def __init__(self, by_keyword):
            super().__init__()
            self.layers, self.by_keyword = torch.nn.ModuleList([Block(4, 4), Block(4, 4)]), by_keyword

        def forward(self, input_ids=None, inputs_embeds=None, use_cache=False):
            h = inputs_embeds * 3.0  # done on the first stage already
            for block in self.layers:
                h = block(hidden_states=h) if self.by_keyword else block(other=h)
            return SimpleNamespace(last_hidden_state=h)

    class LM(torch.nn.Module):
        base_model_prefix = "model"

        def __init__(self, by_keyword):
            super().__init__()
            self.model = Body(by_keyword)

    lm = LM(by_keyword=True)
    x = torch.randn(2, 4)
    expected = lm.model.layers[1](lm.model.layers[0](x))
    assert torch.allclose(StageModule(lm, first=False, last=False)(x), expected)
    with pytest.raises(ModelError, match="without its hidden states"):
        StageModule(LM(by_keyword=False), first=False, last=False)(x)


def _two_documents():
    ids = torch.randint(3, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None].repeat(2, 1)
    return ids, positions


def test_pipeline_stages_keep_packed_documents_apart_as_the_whole_model_does():
    """data.packing=documents under pp: every stage builds its mask from the packed position ids, so the stages
    chained give the whole model's packed logits, and the second document's logits are its own alone."""
    from models.packing import PackedForward

    model, (first, last) = _stages("llama")
    ids, positions = _two_documents()
    with torch.no_grad():
        staged = last(first(ids, packed_position_ids=positions), packed_position_ids=positions)
        whole = PackedForward()(model, ids, positions).logits
        alone = model(input_ids=ids[:, 10:], use_cache=False).logits
        plain = last(first(ids))  # positions counted from 0: the second document sees the first
    assert first.packed_forward.verified and last.packed_forward.verified
    assert torch.allclose(staged, whole, atol=1e-5)
    assert torch.allclose(staged[:, 10:], alone, atol=1e-5)
    assert not torch.allclose(plain[:, 10:], alone, atol=1e-3)


def test_a_pipeline_stage_whose_mask_ignores_packed_positions_is_stopped():
    """OPT builds its mask without the position ids: the first stage's first packed forward says so (one process
    would say the same)."""
    from tessera.errors import ModelError

    _, (first, _) = _stages("opt", ffn_dim=128, word_embed_proj_dim=64)
    ids, positions = _two_documents()
    with pytest.raises(ModelError, match="does not read restarting position ids as packed documents"):
        first(ids, packed_position_ids=positions)


def test_pipeline_stages_over_context_ranks_mask_and_recompute_each_micro_batch_by_its_own_documents(one_rank_group):
    """Packed documents with pp x cp: the schedule runs micro-batch 1's forward before micro-batch 0's backward,
    whose checkpointed blocks recompute then. Each stage masks by its micro-batch's documents (handed in whole
    rows), and a recomputation by the documents its forward had: logits and gradients are the whole model's."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from models.packing import PackedForward
    from trainer.parallel.context_parallel import ContextParallel

    model, stages = _stages("llama")
    cp = ContextParallel(init_device_mesh("cpu", (1,)), "ulysses")
    for stage in stages:
        cp.apply(stage.lm)
        stage.cp = cp
        stage.lm.activation_checkpointing_enable({"use_reentrant": False, "context_fn": cp.recompute_contexts})
        stage.lm.train()
    ids = torch.randint(3, 320, (4, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.cat([torch.arange(10), torch.arange(14)])[None].repeat(2, 1),
                           torch.cat([torch.arange(16), torch.arange(8)])[None].repeat(2, 1)])
    ce = lambda logits, rows: F.cross_entropy(logits.flatten(0, 1), ids[rows].flatten())  # noqa: E731
    reference = PackedForward()(model, ids, positions).logits
    sum(ce(reference[r], r) for r in (slice(0, 2), slice(2, 4))).backward()
    with cp.sharded({"input_ids": ids, "labels": ids, "position_ids": positions}) as batch:
        losses, logits = [], []
        for rows in (slice(0, 2), slice(2, 4)):
            kwargs = {"position_ids": batch["shard_position_ids"][rows],
                      "document_position_ids": batch["document_position_ids"][rows]}
            logits.append(stages[1](stages[0](batch["input_ids"][rows], **kwargs), **kwargs))
            losses.append(ce(logits[-1], rows))
        for loss in losses:  # micro-batch 0's blocks recompute after micro-batch 1's forward
            loss.backward()
    assert torch.allclose(torch.cat(logits), reference, atol=1e-5)
    for stage, layer in ((stages[0], 0), (stages[1], 3)):
        name = f"model.layers.{layer}.self_attn.q_proj.weight"
        assert torch.allclose(stage.lm.get_parameter(name).grad, model.get_parameter(name).grad, atol=1e-6)
