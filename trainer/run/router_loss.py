"""The router's load-balancing loss of a mixture-of-experts model (Switch Transformer eq. 4-6, as transformers'
`load_balancing_loss_func` computes it): num_experts x sum_e f_e P_e over every layer's routed tokens, f_e the
share of top-k assignments to expert e, P_e its mean router probability.

It counts once per micro-batch, whatever the layout: a micro-batch's term is its whole sequences' (under context
parallelism the counts and probability sums are totalled over the context ranks, the other ranks' part entering as
a constant, so the context ranks' summed gradients hold the term once), and a step's loss gains
coef x the mean of its micro-batches' terms over every data-parallel rank, as gradient accumulation over
micro-batch losses gives in other trainers. Every position of a sequence is routed and counted, SFT padding too.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import List, Optional

import torch
from torch.distributed.tensor import DTensor

from tessera.errors import ModelError


def aux_loss_coef(model_cfg, hf_config) -> float:
    """model.router_aux_loss_coef, or null: the model config's own coefficient where it asks for router logits
    (output_router_logits), else 0 (off)."""
    if model_cfg.router_aux_loss_coef is not None:
        return float(model_cfg.router_aux_loss_coef)
    if getattr(hf_config, "output_router_logits", False):
        return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    return 0.0


def routes_tokens(hf_config) -> bool:
    """Whether the model has a top-k router whose logits transformers can return (num_experts_per_tok)."""
    return _num_experts(hf_config) is not None and getattr(hf_config, "num_experts_per_tok", None) is not None


def _num_experts(hf_config) -> Optional[int]:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(hf_config, key, None):
            return int(getattr(hf_config, key))
    return None


def router_modules(model) -> list:
    """The model's routers: the modules transformers records `router_logits` from (its `_can_record_outputs`),
    with the index of the logits in their output."""
    recorders = [m._can_record_outputs["router_logits"] for m in model.modules()
                 if "router_logits" in (getattr(m, "_can_record_outputs", None) or {})]
    if not recorders:
        return []
    target, index = recorders[0].target_class, recorders[0].index or 0
    return [(m, index) for m in model.modules() if isinstance(m, target)]


class RouterBalance:
    """The load-balancing term of the micro-batches of one step on this rank. Forward hooks on the routers keep
    each layer's logits while a training forward runs (not during an activation-checkpointing recompute); the model
    itself is asked for no router logits (`forward_kwargs`), so it computes no loss of its own."""

    def __init__(self, coef: float, hf_config):
        self.coef = coef
        self.num_experts, self.top_k = _num_experts(hf_config), int(hf_config.num_experts_per_tok)
        self.forward_kwargs = {"output_router_logits": False} if getattr(hf_config, "output_router_logits", False) \
            else {}
        self.sum, self.count = None, 0  # this rank's terms since reset() (on the device), for the metrics
        self._captured = None  # the logits of the forward in progress, while capturing()

    def attach(self, model) -> None:
        """Hook the routers of `model` (before any parallel wrapping: the hooks stay on the router modules)."""
        routers = router_modules(model)
        if not routers:
            raise ModelError("model.router_aux_loss_coef: the model's routers cannot be found (transformers records "
                             "no router_logits for it); set model.router_aux_loss_coef=0")
        for module, index in routers:
            module.register_forward_hook(partial(self._keep, index))

    def _keep(self, index, module, args, output) -> None:
        if self._captured is not None and torch.is_grad_enabled():
            self._captured.append(output[index] if isinstance(output, (tuple, list)) else output)

    @contextmanager
    def capturing(self):
        """Keep the router logits of the forward run inside; yields their list."""
        self._captured = captured = []
        try:
            yield captured
        finally:
            self._captured = None

    def reset(self) -> None:
        self.sum, self.count = None, 0

    def term(self, router_logits, cp=None) -> torch.Tensor:
        """The micro-batch's load-balancing loss from its layers' router logits ([tokens, experts] each)."""
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=router_logits[0].device)
        probs = torch.zeros(self.num_experts, dtype=torch.float32, device=counts.device)
        rows = 0
        for logits in router_logits:
            if isinstance(logits, DTensor):  # tensor parallelism: a router replicated over the tp ranks
                logits = logits.full_tensor()
            weights = torch.softmax(logits.float(), dim=-1)
            chosen = torch.topk(weights, self.top_k, dim=-1).indices.reshape(-1)
            counts = counts.index_add(0, chosen, torch.ones(chosen.shape, dtype=counts.dtype, device=counts.device))
            probs = probs + weights.sum(0)
            rows += weights.shape[0]
        rows = torch.tensor(float(rows), device=counts.device)
        if cp is not None:  # the whole sequences' totals; the other ranks' probabilities as a constant
            counts, rows = cp.total(counts), cp.total(rows)
            probs = probs + (cp.total(probs.detach()) - probs.detach())
        term = (counts / rows * probs / rows).sum() * self.num_experts
        self.sum = term.detach().double() if self.sum is None else self.sum + term.detach().double()
        self.count += 1
        return term


def router_loss_problems(cfg, hf_config, dims) -> List[str]:
    """The load-balancing loss's checks before any process group starts."""
    coef = cfg.model.router_aux_loss_coef
    if (coef is not None and coef < 0) or aux_loss_coef(cfg.model, hf_config) == 0:
        return []
    if not routes_tokens(hf_config):
        return [f"model.router_aux_loss_coef={coef}: the {hf_config.model_type} model has no top-k router "
                f"(not a mixture of experts); leave it null"]
    if dims.pp > 1:
        return [f"the router's load-balancing loss (model.router_aux_loss_coef={aux_loss_coef(cfg.model, hf_config)}"
                f"{'' if coef is not None else ', from the model config'}) is not available with pipeline "
                f"parallelism (strategy.pp={dims.pp}): the last stage computes the loss without the other stages' "
                f"routers; set model.router_aux_loss_coef=0 or train without pp"]
    return []
