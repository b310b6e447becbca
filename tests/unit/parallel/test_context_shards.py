"""Context parallelism's pieces without processes: the load-balanced shard of a sequence, packed documents from
position ids, the degree in ParallelDims, and the checks before any process group starts (the attention across
ranks is checked end to end: tests/integration/test_context_parallel.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Qwen3Config

from trainer.parallel.context_parallel import cp_problems, document_ids, shard_order
from trainer.parallel.dims import ParallelDims
from tessera.errors import ModelError


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_rank_holds_an_early_and_a_late_chunk_and_together_every_token_once(cp):
    order = shard_order(32, cp)
    assert sorted(order.tolist()) == list(range(32))
    chunk = 32 // (2 * cp)
    for rank, mine in enumerate(order.view(cp, -1)):
        assert mine[:chunk].tolist() == list(range(rank * chunk, (rank + 1) * chunk))
        assert mine[chunk:].tolist() == list(range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk))
    # causal work per rank (keys before each query) is the same on every rank
    work = [int((mine + 1).sum()) for mine in order.view(cp, -1)]
    assert len(set(work)) == 1, work


def test_documents_start_where_positions_do_not_go_on():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [5, 6, 7, 8, 0, 1, 2, 3]])
    assert document_ids(positions).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3], [1, 1, 1, 1, 2, 2, 2, 2]]


def _strategy(**kw):
    base = dict(dp_replicate=1, dp_shard=-1, tp=1, pp=1, cp=1, ep=1, cp_impl="ulysses", sequence_parallel=False)
    return SimpleNamespace(**{**base, **kw})


def test_the_context_degree_multiplies_the_world_but_not_the_data_parallel_ranks():
    dims = ParallelDims.from_config(_strategy(cp=2, tp=2), 8)
    assert (dims.dp_shard, dims.cp, dims.tp, dims.dp_size) == (2, 2, 2, 2)
    assert dims.mesh_shape() == (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (1, 1, 2, 2, 2))
    # the 4 ranks of a data-parallel rank (2 context x 2 tensor) read the same batches
    assert [dims.dp_coordinates(r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert ParallelDims.problems(_strategy(cp=0), 2) == [
        "strategy.cp=0 must be a positive degree (1: no context parallelism)"]
    assert ParallelDims.problems(_strategy(cp=-1), 2)
    assert "strategy.cp=3" in ParallelDims.problems(_strategy(cp=3), 4)[0]
    # without context parallelism the messages read as before
    assert "strategy.cp" not in ParallelDims.problems(_strategy(dp_shard=3), 4)[0]


def _cfg(seq_len=64, packing="eos", **strategy):
    return SimpleNamespace(strategy=_strategy(**strategy), data=SimpleNamespace(seq_len=seq_len, packing=packing))


def _info(config):
    config._attn_implementation = "sdpa"
    return SimpleNamespace(hf_config=config)


LLAMA = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2, vocab_size=320)


def test_heads_split_over_tensor_and_context_ranks():
    """Query heads per tensor-parallel rank divide by cp; key/value heads divide by it, or it by them (each context
    rank then gets a repeat of the one its query heads read)."""
    info = _info(LlamaConfig(**LLAMA))
    assert cp_problems(_cfg(cp=2), info, ParallelDims(1, 1, 1, 1, 2, cp=2), "cpu") == []
    # 2 key/value heads over 4 context ranks: repeated; 8 heads / tp 2 = 4 per rank, 1 key/value head per rank
    assert cp_problems(_cfg(cp=4), info, ParallelDims(1, 1, 1, 1, 4, cp=4), "cpu") == []
    assert cp_problems(_cfg(cp=2, tp=2), info, ParallelDims(1, 1, 2, 1, 4, cp=2), "cpu") == []
    three = _info(LlamaConfig(**{**LLAMA, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48}))
    assert cp_problems(_cfg(cp=2), three, ParallelDims(1, 1, 1, 1, 2, cp=2), "cpu") == [
        "strategy.cp=2 (cp_impl=ulysses) splits the key/value heads of each tensor-parallel rank over the context "
        "ranks, or repeats them where there are fewer: the llama model has 3 key/value heads, 3/strategy.tp=1 per "
        "rank, which strategy.cp must divide or be divided by; change strategy.cp or strategy.tp"]
    problems = cp_problems(_cfg(cp=4), three, ParallelDims(1, 1, 1, 1, 4, cp=4), "cpu")
    assert len(problems) == 1 and "the llama model has 6 attention heads, not divisible by strategy.tp x " \
                                  "strategy.cp = 4" in problems[0]
    from transformers import MambaConfig

    problems = cp_problems(_cfg(cp=2), _info(MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=320)),
                           ParallelDims(1, 1, 1, 1, 2, cp=2), "cpu")
    assert "strategy.cp=2 splits attention over the context ranks: the mamba model has no attention heads " \
           "(num_attention_heads); use strategy.cp=1" in problems and not any("None" in p for p in problems)


def test_fewer_key_value_heads_than_context_ranks_are_repeated_for_the_ranks_query_heads():
    """Falcon's multi-query attention (1 key/value head) over 2 context ranks: each rank's share of the repeated
    heads is the head its query heads read, the kernel is told its own group size, and the repeats' gradients
    add up in the one head."""
    from trainer.parallel.context_parallel import _kv_for_every_rank, _on_heads

    module = torch.nn.Module()
    module.num_key_value_groups = 8
    key = torch.randn(1, 1, 4, 2, requires_grad=True)
    k, v = _kv_for_every_rank(module, 8, key, key * 2, 2)
    assert k.shape == (1, 2, 4, 2) and torch.equal(k[:, 0], k[:, 1]) and torch.equal(v, 2 * k)
    k.sum().backward()
    assert torch.equal(key.grad, torch.full_like(key, 2.0))
    gqa = torch.randn(1, 4, 4, 2)  # 4 key/value heads over 2 ranks: split, not repeated
    assert _kv_for_every_rank(module, 8, gqa, gqa, 2)[0] is gqa
    view, _ = _on_heads(module, {}, 8, slice(0, 4), 4)  # 4 query heads per key/value head on this rank
    assert view.num_key_value_groups == 4
    with pytest.raises(ModelError, match="runs 8 query and 3 key/value heads per rank"):
        _kv_for_every_rank(module, 8, torch.randn(1, 3, 4, 2), torch.randn(1, 3, 4, 2), 2)


@pytest.mark.parametrize("kind,where", [
    ("qwen3_5_text", "its linear_attention layers"),
    ("lfm2", "its conv layers"),
    ("mamba", "its linear_attention layers"),  # transformers lists Mamba's mixers as linear attention
])
def test_a_model_mixing_tokens_outside_attention_is_refused(kind, where):
    """Linear attention, short convolutions and state-space scans would run on a rank's shard of the sequence
    alone: refused before training, by the layer types or a convolution inside the blocks."""
    from transformers import AutoConfig

    from models.init import meta_model
    from trainer.parallel.context_parallel import cp_model_problems

    config = AutoConfig.for_model(kind, hidden_size=64, num_hidden_layers=4, vocab_size=320, num_attention_heads=4,
                                  num_key_value_heads=2)
    if kind == "lfm2":
        config.layer_types = ["conv", "full_attention", "conv", "full_attention"]
    model = meta_model(config)
    problems = cp_model_problems(model, 2)
    assert len(problems) == 1 and f"the {kind} model mixes tokens outside attention" in problems[0], problems
    assert where in problems[0] and problems[0].endswith("use strategy.cp=1")
    assert cp_model_problems(model, 1) == []
    if kind == "lfm2":  # no layer types to read: the convolution inside the blocks is found
        model.config.layer_types = None
        assert "(Conv1d model.layers.0.conv.conv)" in cp_model_problems(model, 2)[0]
    assert cp_model_problems(meta_model(LlamaConfig(**LLAMA)), 2) == []


def test_sequence_and_positions_problems_and_pipeline_stages_accepted():
    dims = ParallelDims(1, 1, 1, 2, 4, cp=2)
    problems = cp_problems(_cfg(seq_len=30, cp=2, sequence_parallel=True), _info(LlamaConfig(**LLAMA)), dims, "cpu")
    assert len(problems) == 2, problems
    assert any("strategy.sequence_parallel=true with strategy.cp" in p for p in problems)
    assert any("data.seq_len=30 must be divisible by 2 x strategy.cp = 4" in p for p in problems)
    # pipeline stages are handed the shard's positions (tests/integration/test_context_parallel.py)
    assert cp_problems(_cfg(seq_len=32, cp=2), _info(LlamaConfig(**LLAMA)), dims, "cpu") == []


def test_ring_needs_cuda_and_plain_causal_attention():
    dims = ParallelDims(1, 1, 1, 1, 2, cp=2)
    sliding = _info(Qwen3Config(**LLAMA, use_sliding_window=True, sliding_window=16))
    problems = cp_problems(_cfg(cp=2, cp_impl="ring", packing="documents"), sliding, dims, "cpu")
    assert any("needs CUDA attention kernels" in p for p in problems)
    assert any("data.packing=documents needs strategy.cp_impl=ulysses" in p for p in problems)
    assert any("sliding window, attention chunks or logit soft-capping" in p for p in problems)
    assert cp_problems(_cfg(cp=2, cp_impl="ring"), _info(LlamaConfig(**LLAMA)), dims, "cuda") == []
    assert cp_problems(_cfg(cp_impl="ring"), _info(LlamaConfig(**LLAMA)), ParallelDims(1, 1, 1, 1, 1), "cpu") == [
        "strategy.cp_impl=ring is read with strategy.cp > 1 only"]


def test_chunked_attention_is_masked_by_ulysses_and_refused_by_ring_and_flash():
    """Llama 4's chunked layers: Ulysses masks each query to the keys of its own chunk of the whole sequence (as the
    model's own chunked mask does on one process; before, the plain causal mask let it see every earlier key);
    ring attention and flash kernels take no such mask and are refused before any group starts."""
    from transformers import Llama4TextConfig

    from trainer.parallel.context_parallel import ContextParallel, chunk_size

    config = Llama4TextConfig(**LLAMA, head_dim=16, attention_chunk_size=4, no_rope_layers=[0, 1])
    assert config.layer_types == ["full_attention", "chunked_attention"]
    layer = SimpleNamespace(config=config, layer_idx=1)
    assert chunk_size(layer) == 4 and chunk_size(SimpleNamespace(config=config, layer_idx=0)) is None
    cp = ContextParallel.__new__(ContextParallel)
    cp.inner, cp.documents, cp.masks = "sdpa", None, {}
    mask = cp._mask(torch.zeros(1, 2, 8, 16), None, 4)[0, 0]
    expected = torch.tensor([[k <= q and k // 4 == q // 4 for k in range(8)] for q in range(8)])
    assert torch.equal(mask, expected)
    assert cp._mask(torch.zeros(1, 2, 8, 16), None, None) is None  # SDPA masks causally itself
    dims = ParallelDims(1, 1, 1, 1, 2, cp=2)
    ring = cp_problems(_cfg(cp=2, cp_impl="ring"), _info(config), dims, "cuda")
    assert any("attention chunks" in p for p in ring)
    info = _info(config)
    info.hf_config._attn_implementation = "flash_attention_2"
    assert any("chunked attention layers need a mask" in p for p in cp_problems(_cfg(cp=2), info, dims, "cuda"))


def test_per_head_parameters_are_sliced_to_this_ranks_heads():
    """gpt-oss's sinks (one logit per head, also passed as s_aux): the kernel of a context rank sees its heads'
    sinks, and the gradient reaches the whole parameter."""
    from trainer.parallel.context_parallel import _on_heads

    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(torch.arange(4.0))
    module.scaling = 0.5
    view, kwargs = _on_heads(module, {"s_aux": module.sinks, "sliding_window": 16}, 4, slice(2, 4), 1)
    assert view.sinks.tolist() == [2.0, 3.0] and kwargs["s_aux"].tolist() == [2.0, 3.0]
    assert view.scaling == 0.5 and kwargs["sliding_window"] == 16
    view.sinks.sum().backward()
    assert module.sinks.grad.tolist() == [0.0, 0.0, 1.0, 1.0]
    plain = torch.nn.Linear(2, 2)
    assert _on_heads(plain, {"x": 1}, 2, slice(0, 1), 1) == (plain, {"x": 1})  # no per-head parameter of its own


def test_learned_positions_split_too_and_unknown_kernels_are_refused():
    dims = ParallelDims(1, 1, 1, 1, 2, cp=2)
    gpt2 = GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=320)
    assert cp_problems(_cfg(cp=2), _info(gpt2), dims, "cpu") == []  # GPT-2 takes position_ids
    info = _info(LlamaConfig(**LLAMA))
    info.hf_config._attn_implementation = "flex_attention"
    assert "attention implementation 'flex_attention' cannot be split" in cp_problems(_cfg(cp=2), info, dims,
                                                                                       "cpu")[0]


def test_the_expert_degree_borrows_data_and_context_ranks():
    """strategy.ep adds no ranks: it must divide dp_shard x cp (after -1 is filled)."""
    dims = ParallelDims.from_config(_strategy(cp=2, ep=4), 8)
    assert (dims.dp_shard, dims.cp, dims.ep, dims.dp_size, dims.world_size) == (4, 2, 4, 4, 8)
    assert ParallelDims.problems(_strategy(ep=3), 2) == [
        "strategy.ep=3 splits the experts over data-parallel shard (x context) ranks: it must divide "
        "strategy.dp_shard x strategy.cp = 2"]
    assert ParallelDims.problems(_strategy(ep=0), 2) == [
        "strategy.ep=0 must be a positive degree (1: no expert parallelism)"]
    assert ParallelDims.problems(_strategy(tp=2, ep=2), 2)  # dp_shard fills 1 rank: nothing to borrow
