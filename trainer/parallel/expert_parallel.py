"""Expert parallelism for Hugging Face mixture-of-experts blocks: `apply_ep(model, ep_mesh)` splits every experts
module (a module named `experts` whose 3-D parameters have the number of experts as their first dimension, as
transformers' fused `@use_experts_implementation` classes store them) over the expert-parallel ranks, and routes
each token to the rank that holds its expert (dropless: every assignment is computed, none is capped).

Layout: each per-expert parameter becomes a DTensor sharded Shard(0) over `ep_mesh`; rank r keeps experts
[r*E/N, (r+1)*E/N). Under tensor parallelism the mesh is (ep, tp) and the experts Replicate over tp: the tp ranks
of an expert rank see the same tokens and compute the same (attention is what tp splits). Parameter names are unchanged, so DCP checkpoints and `full_tensor()` exports keep the
model's own layout.

Forward (replacing the experts module's, with the same signature `(hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]`): the (token, k) assignments sorted by expert; the tokens-per-expert counts
exchanged (all_to_all_single), so each rank knows how many rows it receives for each local expert from each
rank; the rows sent with an autograd-aware all-to-all; the local experts run by the module's own experts
implementation (transformers' eager loop, grouped_mm or batched_mm, whichever `config._experts_implementation`
picks for the device) on the local shards; the results sent back with the reverse all-to-all, weighted and
summed into the tokens with `index_add_`, as the eager forward combines.

Gradients: a local expert's gradient is the sum over the tokens of the whole ep group (every ep rank's loss);
it is not reduced over the ep group here. A data-parallel caller reduces it over the ranks that hold the same
experts only; where that reduction sums and each loss is its share of the global loss (Tessera's FSDP), no
rescaling is needed (an averaging reduction would leave the experts' gradients ep times too large).
"""
from __future__ import annotations

import inspect
import types
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from models.init import meta_model, text_config
from tessera.errors import ConfigError

# Hugging Face config keys that hold the number of routed experts (Mixtral/GPT-OSS, Qwen-MoE/OLMoE,
# DeepSeek/GLM-MoE, ERNIE-MoE).
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _expert_count(module: nn.Module) -> Optional[int]:
    """The number of experts of a candidate experts module: the common first dimension of its own 3-D parameters
    (and its `num_experts` where it has one), or None when it holds none or they disagree."""
    firsts = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}
    if not firsts:
        return None
    declared = getattr(module, "num_experts", None)
    if isinstance(declared, int):
        firsts.add(declared)
    return firsts.pop() if len(firsts) == 1 else None


def expert_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(qualified name, module) of every experts module: named `experts`, holding 3-D parameters whose first
    dimension is the number of experts (transformers' fused layout; a ModuleList of MLPs is not one)."""
    return [(name, m) for name, m in model.named_modules()
            if name.rpartition(".")[2] == "experts" and _expert_count(m) is not None]


def _config_expert_count(config) -> Optional[int]:
    """The number of routed experts a Hugging Face config declares (its text config's, for multimodal ones)."""
    text = text_config(config)
    for source in (text, config):
        for key in EXPERT_COUNT_KEYS:
            value = getattr(source, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return value
    return None


def _takes_routing(module: nn.Module) -> bool:
    """Whether the experts' forward is the (hidden_states, top_k_index, top_k_weights) kind with a `num_experts`
    (what the expert-parallel forward calls on the local experts); Llama 4's experts, for one, take only the
    hidden states, already repeated per expert."""
    if not isinstance(getattr(module, "num_experts", None), int):
        return False
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]  # follows functools.wraps
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _shared_parameters(module: nn.Module, num_experts: int) -> List[str]:
    """Names of the experts module's parameters that are not one slice per expert (a norm shared by all
    experts, say): expert parallelism could only keep them whole, with a gradient from other ranks' tokens."""
    own = {id(p) for p in module.parameters(recurse=False)}
    return [name for name, p in module.named_parameters()
            if id(p) not in own or p.dim() == 0 or p.shape[0] != num_experts]


def _no_experts(ep: int, model_type: str) -> str:
    return (f"strategy.ep={ep} needs a mixture-of-experts model whose experts are fused 3-D tensors; "
            f"{model_type} has none")


def _indivisible(ep: int, model_type: str, count: int) -> str:
    return f"strategy.ep={ep} must divide the number of experts of {model_type} ({count}); choose a divisor of {count}"


def _module_problems(model: nn.Module, ep: int, model_type: str) -> List[str]:
    """ep_problems on a built (or meta) model: each distinct problem of its experts modules once."""
    found = expert_modules(model)
    if not found:
        return [_no_experts(ep, model_type)]
    problems = []
    for _, module in found:
        count, kind = _expert_count(module), type(module).__name__
        found_problems = [_indivisible(ep, model_type, count)] if count % ep else []
        if not _takes_routing(module):
            found_problems.append(f"strategy.ep={ep} can't split {model_type}'s {kind}: its forward does not take "
                                  f"(hidden_states, top_k_index, top_k_weights) with a num_experts attribute")
        shared = _shared_parameters(module, count)
        if shared:
            found_problems.append(f"strategy.ep={ep} can't split {model_type}'s {kind}: its parameter(s) "
                                  f"{', '.join(shared)} are shared by all experts, not one slice per expert")
        problems.extend(p for p in found_problems if p not in problems)
    return problems


def ep_problems(model_config_or_model, ep: int) -> List[str]:
    """User-facing problems (one sentence each, naming strategy.ep) with splitting this model's experts over `ep`
    ranks; [] when it can be done or ep is 1. A Hugging Face config is answered from its expert count where that
    settles it (no experts: a dense model), otherwise from the model built on the meta device (no memory), so
    this runs before the real model is built."""
    if ep <= 1:
        return []
    target = model_config_or_model
    config = getattr(target, "config", None) if isinstance(target, nn.Module) else target
    model_type = getattr(config, "model_type", None) or type(target).__name__
    if not isinstance(target, nn.Module):
        count = _config_expert_count(config)
        if count is None:
            return [_no_experts(ep, model_type)]
        try:
            target = meta_model(config)
        except Exception:  # noqa: BLE001 - transformers raises many kinds; the config's count is then all we know
            return [_indivisible(ep, model_type, count)] if count % ep else []
    return _module_problems(target, ep, model_type)


def _shard(param: torch.Tensor, mesh, rank: int, per_rank: int) -> DTensor:
    """This rank's experts [rank*per_rank, (rank+1)*per_rank) of a full (or meta) tensor, as a DTensor of the full
    shape, Shard(0) over the mesh's first (ep) dimension, Replicate over a second (tp); each rank holds the same
    full tensor (tensor parallelism's replicated DTensor), so no communication is needed."""
    whole = param.detach().to_local() if isinstance(param, DTensor) else param.detach()
    local = whole[rank * per_rank:(rank + 1) * per_rank].clone()  # own storage: the full one can go
    placements = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())


def apply_ep(model: nn.Module, ep_mesh) -> None:
    """Split every experts module of `model` over the DeviceMesh `ep_mesh`, 1-D or (ep, tp) (its ep ranks are
    data-parallel ranks that each feed their own tokens): per-expert parameters become Shard(0) DTensors, on the meta device too
    (the model is filled later), and the module's forward routes tokens to the experts' ranks. A no-op when the
    mesh has one rank. Raises ConfigError with `ep_problems`' messages when the model can't be split.

    Gradients: a local expert's gradient is the sum over all the ep group's tokens, i.e. of the ep ranks'
    losses together; nothing reduces it over the ep group. The caller's data-parallel reduction of the expert
    parameters runs over the data-parallel ranks that hold the same experts (one per ep group); see the module
    docstring for its scaling."""
    placed, ep_mesh = ep_mesh, ep_mesh["ep"] if ep_mesh.ndim > 1 else ep_mesh
    n_ranks = ep_mesh.size()
    if n_ranks == 1:
        return
    config = getattr(model, "config", None)
    problems = _module_problems(model, n_ranks, getattr(config, "model_type", None) or type(model).__name__)
    if problems:
        raise ConfigError(problems)
    rank = ep_mesh.get_local_rank()
    for _, experts in expert_modules(model):
        per_rank = _expert_count(experts) // n_ranks
        for key, p in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(key, nn.Parameter(_shard(p, placed, rank, per_rank),
                                                         requires_grad=p.requires_grad))
        experts._tessera_ep_mesh = ep_mesh
        experts.forward = types.MethodType(_ep_forward, experts)  # an instance attribute: names and class unchanged


def _routing_plan(expert_ids: torch.Tensor, num_experts: int, n_ranks: int, group):
    """From the sorted expert ids of this rank's assignments: the rows it sends to each rank, the rows it
    receives from each, and the local expert (0..E/N-1) of every received row. The counts are exchanged with
    one all-to-all, and read to the host once (the split sizes must be known)."""
    counts = torch.bincount(expert_ids, minlength=num_experts)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert], flattened
    per_rank = num_experts // n_ranks
    sent_counts, received_counts = torch.stack([counts, received]).tolist()
    send = [sum(sent_counts[r * per_rank:(r + 1) * per_rank]) for r in range(n_ranks)]
    recv = [sum(received_counts[r * per_rank:(r + 1) * per_rank]) for r in range(n_ranks)]
    local = torch.arange(per_rank, device=expert_ids.device).repeat(n_ranks)
    local_ids = torch.repeat_interleave(local, received, output_size=sum(recv))
    return send, recv, local_ids


def _all_to_all(rows: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
    """All-to-all of rows with split sizes whose backward is the reverse all-to-all (zero splits and empty
    inputs included: every rank takes part)."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, group))


def _local_experts(module: nn.Module, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """Each received row through its local expert, unweighted, by the module's own experts implementation run
    on a shallow copy holding the local shards (`to_local`: the gradient reaches the DTensor parameters)."""
    local = {k: p.to_local() if isinstance(p, DTensor) else p for k, p in module._parameters.items()}
    if rows.shape[0] == 0:
        # No rows here: the output still depends on the rows and the local experts, so this rank's backward runs
        # the reverse all-to-all like the others' and its experts get a (zero) gradient like theirs.
        ties = [t.reshape(-1)[:0].sum() for t in local.values() if t is not None and t.requires_grad]
        return rows + sum(ties) if ties else rows
    view = object.__new__(type(module))  # a shallow copy; copy.copy would run FSDP's class __new__ (re-init)
    view.__dict__.update(module.__dict__)
    view.__dict__.pop("forward", None)
    view.__dict__["_parameters"] = local
    view.__dict__["num_experts"] = module.num_experts // module._tessera_ep_mesh.size()
    ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    return type(module).forward(view, rows, local_ids.unsqueeze(-1), ones).to(rows.dtype)  # one dtype on every rank


def _ep_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The expert-parallel forward of an experts module (bound to it by apply_ep): same inputs and output as the
    model's own experts forward, and the same combination (weights applied, then index_add_ by expert order)."""
    mesh = self._tessera_ep_mesh
    group = mesh.get_group()
    top_k = top_k_index.shape[-1]
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    token = order // top_k
    send, recv, local_ids = _routing_plan(expert_ids, self.num_experts, mesh.size(), group)
    received = _all_to_all(hidden_states[token], recv, send, group)
    returned = _all_to_all(_local_experts(self, received, local_ids), send, recv, group)
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(hidden_states).index_add_(0, token, (returned * weights).to(hidden_states.dtype))
