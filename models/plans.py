"""Model-parallel plans, declarative (no distributed code here; trainer/strategies/model_parallel.py applies
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

from dataclasses import dataclass, field
from typing import Dict, List, Optional

SUPPORTED_TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise")

# Plans for architectures whose config has none; same style names as Hugging Face's.
_OWN_TP_PLANS = {
    "llama": {
        "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
    },
}


def tp_plan(model, tp: int) -> Optional[Dict[str, str]]:
    """The tensor-parallel plan of `model` (full module paths with `*` for a layer index), or None when the
    architecture has none."""
    config = model.config
    base = getattr(config, "base_model_tp_plan", None) or _OWN_TP_PLANS.get(config.model_type)
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    plan = {(f"{prefix}.{k}" if prefix else k): v for k, v in base.items()}
    vocab = getattr(config, "vocab_size", 0)
    # Tied embeddings would need one weight split two ways: both stay replicated then.
    if vocab and vocab % tp == 0 and not getattr(config, "tie_word_embeddings", False):
        embed = model.get_input_embeddings()
        head = model.get_output_embeddings()
        names = {id(m): n for n, m in model.named_modules()}
        if embed is not None and id(embed) in names:
            plan[names[id(embed)]] = "embedding_rowwise"
        if head is not None and id(head) in names:
            plan[names[id(head)]] = "colwise_gather_output"
    return plan


def tp_plan_problems(model_type: str, has_plan: bool, info, tp: int) -> List[str]:
    problems = []
    if tp <= 1:
        return problems
    if not has_plan:
        problems.append(f"strategy.tp={tp}: the {model_type} architecture has no tensor-parallel plan (its config "
                        f"has no base_model_tp_plan and Tessera has none for it); set strategy.tp=1 or use a "
                        f"Llama-style model")
    if info.num_heads % tp:
        problems.append(f"strategy.tp={tp} must divide the attention heads ({info.num_heads}); change strategy.tp or "
                        f"model.num_heads")
    if info.num_kv_heads % tp:
        problems.append(f"strategy.tp={tp} must divide the key/value heads ({info.num_kv_heads}); change strategy.tp "
                        f"or model.num_kv_heads")
    return problems


@dataclass
class PipelineSplit:
    layers: str  # path of the ModuleList of decoder blocks
    first: List[str]  # modules of the first stage only
    last: List[str]  # modules of the last stage only
    zeroed_on_later_stages: List[str] = field(default_factory=list)


_SPLITS = {
    "gpt2": PipelineSplit("transformer.h", ["transformer.wte", "transformer.wpe"], ["transformer.ln_f", "lm_head"],
                          zeroed_on_later_stages=["transformer.wpe"]),
}


def pipeline_split(model) -> Optional[PipelineSplit]:
    """How to cut `model` into pipeline stages; Llama-like decoders (`model.embed_tokens`, `model.layers`,
    `model.norm`, `lm_head`: Llama, Mistral, Qwen2/3, ...) are found by their module names."""
    model_type = model.config.model_type
    if model_type in _SPLITS:
        return _SPLITS[model_type]
    names = {n for n, _ in model.named_modules()}
    prefix = getattr(model, "base_model_prefix", "model")
    if {f"{prefix}.embed_tokens", f"{prefix}.layers", f"{prefix}.norm", "lm_head"} <= names:
        return PipelineSplit(f"{prefix}.layers", [f"{prefix}.embed_tokens"], [f"{prefix}.norm", "lm_head"])
    return None


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
