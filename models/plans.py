"""Model-parallel plans, declarative (no distributed code here; trainer/parallel/tensor_parallel.py and pipeline.py apply
them).

* Tensor parallelism: {module path pattern: style} with Hugging Face's style names: the config's
  `base_model_tp_plan` (prefixed with the causal LM's `base_model_prefix`) where the architecture has one,
  else ours (Llama-style presets share Llama's). Embeddings are split over the vocabulary ("embedding_rowwise")
  and the LM head over its outputs with the logits gathered ("colwise_gather_output"), when the vocabulary
  divides by the degree.
* Pipeline parallelism: where the decoder's blocks live (a ModuleList) and which modules belong to the first
  stage (embeddings) and the last (final norm, head); modules listed in `zeroed_on_later_stages` are additive
  position embeddings that later stages must not add again.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from torch import nn

from models.init import base_model_path, decoder_blocks, text_config

# Hugging Face's plan styles that Tessera applies (trainer/parallel/tensor_parallel.py). `moe_tp_experts`:
# the experts stay whole on every rank (their parameter-level entries, `packed_colwise` and the like, are then
# not applied); attention and dense MLPs are split.
SUPPORTED_TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise",
                       "rowwise_split_input", "replicated_with_grad_allreduce", "moe_tp_experts", "mla_kv_a_proj")

# Plans for architectures whose config has none; same style names as Hugging Face's.
_OWN_TP_PLANS = {
    "llama": {
        "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
    },
}


def layer_pattern(name: str) -> str:
    """A module name with its layer (and expert) indices as `*`, as plans name modules: `model.layers.*.mlp`."""
    return re.sub(r"\.\d+\.", ".*.", name)


def ties_embeddings(model) -> bool:
    """Whether the input embedding and the LM head are one weight."""
    config = model.config
    text = text_config(config)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is not None and head is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0):
        return True
    return bool(getattr(text, "tie_word_embeddings", False) and head is not None)


def embedding_weight_names(model) -> Tuple[Optional[str], Optional[str]]:
    """(the input embedding's weight name, the LM head's), None for one the model lacks; where they are tied the
    head's name is the one named_parameters drops."""
    names = {id(m): n for n, m in model.named_modules()}

    def weight(module):
        return f"{names[id(module)]}.weight".lstrip(".") if module is not None and id(module) in names else None

    return weight(model.get_input_embeddings()), weight(model.get_output_embeddings())


def is_moe(model) -> bool:
    """Whether the model has mixture-of-experts blocks (modules named `experts`)."""
    return any(n.rpartition(".")[2] == "experts" for n, _ in model.named_modules())


def tp_plan(model, tp: int) -> Optional[Dict[str, str]]:
    """The tensor-parallel plan of `model` (full module paths with `*` for a layer index), or None when the
    architecture has none."""
    config = model.config
    base = getattr(config, "base_model_tp_plan", None) or _OWN_TP_PLANS.get(config.model_type)
    if not base:
        return None
    prefix = base_model_path(model)
    plan = {(f"{prefix}.{k}" if prefix else k): v for k, v in base.items()}
    if is_moe(model) and "moe_tp_experts" not in plan.values():
        # transformers >= 5.25 lists the experts in its expert-parallel plan only: they stay whole here too.
        for name, _ in model.named_modules():
            if name.rpartition(".")[2] == "experts":
                plan[layer_pattern(name)] = "moe_tp_experts"
    # Experts stay whole (moe_tp_experts): their parameter-level entries (packed_colwise, ...) do not apply.
    whole = [k for k, v in plan.items() if v == "moe_tp_experts"]
    plan = {k: v for k, v in plan.items() if not any(k.startswith(w + ".") for w in whole)}
    plan.update(_learned_activations(model, plan))
    vocab = getattr(config, "vocab_size", 0)
    names = {id(m): n for n, m in model.named_modules()}
    embed = model.get_input_embeddings()
    if ties_embeddings(model) and embed is not None:
        # Tied embeddings would need one weight split two ways: both stay replicated then.
        plan.pop(names.get(id(embed)), None)
        return plan
    if vocab and vocab % tp == 0:
        head = model.get_output_embeddings()
        if embed is not None and id(embed) in names:
            plan[names[id(embed)]] = "embedding_rowwise"
        if head is not None and id(head) in names:
            plan[names[id(head)]] = "colwise_gather_output"
    else:
        plan.pop(names.get(id(embed)), None)  # a vocabulary that does not divide: embeddings and head stay whole
    return plan


def _learned_activations(model, plan: dict) -> Dict[str, str]:
    """Activations with parameters (Apertus' xIELU scalars) beside column-parallel projections: they act on
    this rank's columns, so their gradient is a partial sum over the tensor-parallel ranks
    (`replicated_with_grad_allreduce`, as Hugging Face's plans name the per-head norms)."""
    split = {n.rpartition(".")[0] for n, st in resolve_plan(model, plan).items() if st == "colwise"}
    return {layer_pattern(name): "replicated_with_grad_allreduce" for name, m in model.named_modules()
            if name.rpartition(".")[0] in split and "act" in name.rpartition(".")[2]
            and any(True for _ in m.parameters(recurse=False))}


def resolve_plan(part: nn.Module, plan: dict) -> dict:
    """{module name: style name} for the modules of `part` the plan's patterns match (`*` is a layer index)."""
    names = [n for n, m in part.named_modules() if n and not isinstance(m, nn.Identity) and m is not None]
    resolved = {}
    for pattern, style in plan.items():
        regex = pattern.replace(".", r"\.").replace("*", r"\d+")
        for n in names:
            if re.fullmatch(regex, n):
                resolved[n] = style
    return resolved


def _splits_blocks(model, plan: dict) -> bool:
    """Whether the plan splits a module inside the decoder blocks (the experts kept whole do not count)."""
    blocks = tuple(name + "." for name, _ in decoder_blocks(model))
    return any(n.startswith(blocks) and st != "moe_tp_experts" for n, st in resolve_plan(model, plan).items())


def tp_plan_problems(model, info, tp: int) -> List[str]:
    """Whether `model` can be split `tp` ways: a plan whose styles Tessera applies, heads that divide."""
    problems = []
    if tp <= 1:
        return problems
    model_type = model.config.model_type
    plan = tp_plan(model, tp)
    if plan is None:
        problems.append(f"strategy.tp={tp}: the {model_type} architecture has no tensor-parallel plan (its config "
                        f"has no base_model_tp_plan, and its attention is not laid out for Tessera's own plan); "
                        f"set strategy.tp=1 (fsdp, pp and ZeRO train it)")
    elif not _splits_blocks(model, plan):
        named = ", ".join(getattr(model.config, "base_model_tp_plan", None) or {})
        problems.append(f"strategy.tp={tp}: the {model_type} tensor-parallel plan splits nothing inside the decoder "
                        f"blocks (its config's base_model_tp_plan names {named or 'nothing'}): every rank would "
                        f"hold and compute whole blocks; set strategy.tp=1 (fsdp, pp and ZeRO train it)")
    else:
        unknown = sorted({st for st in plan.values() if st not in SUPPORTED_TP_STYLES})
        if unknown:
            problems.append(f"strategy.tp={tp}: the {model_type} tensor-parallel plan uses style(s) "
                            f"{', '.join(map(repr, unknown))}, which Tessera does not apply (supported: "
                            f"{', '.join(SUPPORTED_TP_STYLES)}); set strategy.tp=1")
    if info.num_heads and info.num_heads % tp:  # None: no attention heads (a state-space model)
        problems.append(f"strategy.tp={tp} must divide the attention heads ({info.num_heads}); change strategy.tp or "
                        f"model.num_heads")
    if info.num_kv_heads and info.num_kv_heads % tp:
        problems.append(f"strategy.tp={tp} must divide the key/value heads ({info.num_kv_heads}); change strategy.tp "
                        f"or model.num_kv_heads")
    return problems


@dataclass
class PipelineSplit:
    layers: str  # path of the ModuleList of decoder blocks
    first: List[str]  # modules of the first stage only
    last: List[str]  # modules of the last stage only
    zeroed_on_later_stages: List[str] = field(default_factory=list)


def pipeline_split(model) -> Optional[PipelineSplit]:
    """How to cut `model` into pipeline stages, derived from its structure: the ModuleList holding the decoder
    blocks (`models.init.decoder_blocks`), and beside it, in the module that owns that list, the modules with parameters
    that run before the blocks (the token embedding, additive position embeddings, an input projection, a norm of
    the embeddings: by type or name) and after them (final norm, output projection); the LM head outside it runs
    last. Modules without parameters (rotary tables, dropout) stay on every stage. None when the model does not
    have that shape."""
    blocks = decoder_blocks(model)
    if not blocks:
        return None
    layers = {name.rpartition(".")[0] for name, _ in blocks}
    if len(layers) != 1 or not isinstance(model.get_submodule(next(iter(layers))), nn.ModuleList):
        return None
    layers = next(iter(layers))
    owner_path = layers.rpartition(".")[0]
    owner = model.get_submodule(owner_path) if owner_path else model
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or head is None:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    first, last, zeroed = [], [], []
    after_layers = False
    for child_name, child in owner.named_children():
        path = f"{owner_path}.{child_name}" if owner_path else child_name
        after_layers = after_layers or path == layers
        if path == layers or child is None or not any(True for _ in child.parameters()):
            continue
        if child is embed:
            first.append(path)
        elif isinstance(child, nn.Embedding):  # an additive position embedding: later stages add zeros
            first.append(path)
            zeroed.append(path)
        elif any(k in child_name for k in ("proj_in", "project_in")) or "emb" in child_name and not after_layers:
            # an input projection, or a norm of the embeddings (Bloom's word_embeddings_layernorm); one declared
            # after the blocks runs after them (LFM2's final norm is its `embedding_norm`)
            first.append(path)
        else:
            last.append(path)
    if names.get(id(embed)) not in first:
        return None
    # Everything with parameters outside the owner must be the head.
    head_path = names.get(id(head))
    for child_name, child in model.named_children():
        if child is owner or child_name == head_path or not any(True for _ in child.parameters()):
            continue
        if owner_path and owner_path.startswith(child_name + "."):
            continue
        return None
    if head_path is None:
        return None
    return PipelineSplit(layers, first, last + [head_path], zeroed_on_later_stages=zeroed)


def stage_layers(num_layers: int, num_stages: int, split_points: Optional[List[int]] = None) -> List[range]:
    """Layer indices of each stage: balanced (the first stages take one more when it doesn't divide), or
    starting at `split_points` (the first layer of stages 1..S-1)."""
    if split_points:
        starts = [0, *split_points, num_layers]
        return [range(a, b) for a, b in zip(starts[:-1], starts[1:])]
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def split_problems(num_layers: int, num_stages: int, split_points) -> List[str]:
    if num_stages <= 1:
        return []
    if split_points:
        pts = list(split_points)
        if len(pts) != num_stages - 1:
            return [f"strategy.pp_split_points has {len(pts)} entries; {num_stages} stages need {num_stages - 1} "
                    f"(the first layer of each stage after the first)"]
        if pts != sorted(set(pts)) or pts[0] <= 0 or pts[-1] >= num_layers:
            return [f"strategy.pp_split_points={pts} must be increasing layer indices in 1..{num_layers - 1}, so that "
                    f"every stage has at least one layer"]
        return []
    if num_stages > num_layers:
        return [f"{num_stages} pipeline stages (strategy.pp x strategy.pp_stages_per_rank) need at least one layer "
                f"each, but the model has {num_layers}; lower strategy.pp or strategy.pp_stages_per_rank"]
    return []
