"""What a resumed run does with config values that differ from its checkpoint's.

Every difference is either refused before any process group starts (it would change what is being trained in a
way the checkpoint cannot carry: the model, the data or its order) or applied and reported once at resume:

- refused: the model's architecture (its Hugging Face config, e.g. rope_theta or an epsilon; shapes are checked
  separately), `train.seed` (it sets the order of the epoch in progress), `optim.name`, `train.global_batch_size`
  and the data (checked in trainer/checkpoint/manager.py);
- applied to the restored optimizer: `optim.lr` (the schedule continues at the current step with the new peak
  lr), `optim.weight_decay` (on the decayed group: matrices), `optim.betas`, `optim.eps`, `optim.momentum`,
  `optim.nesterov`;
- the schedule (`scheduler.*`, `train.max_steps`) is recomputed from the new values at the current step;
- everything else (logging, evaluation, checkpointing, export, the strategy and world size, precision,
  clipping, micro-batch size) is taken as given.

`checkpoint.load_weights_only=true` starts a new run from the weights: nothing is carried over, nothing refused.
The run's config.yaml records the values used.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

from trainer.run.optim import configured_values, lr_factor

PER_INVOCATION = ("checkpoint.resume", "checkpoint.load_weights_only", "checkpoint.overwrite")
REFUSED = {"train.seed": "it sets the data order of the epoch in progress"}
OPTIMIZER = ("optim.lr", "optim.weight_decay", "optim.betas", "optim.eps", "optim.momentum", "optim.nesterov")
SCHEDULE = ("scheduler.name", "scheduler.warmup_steps", "scheduler.min_lr_ratio", "train.max_steps")
# Model keys that do not change what the weights compute (the attention kernel, where the config came from).
MODEL_FREE = ("model.attn_implementation", "model.name_or_path", "model.revision", "model.trust_remote_code",
              "model.tokenizer")
# Hugging Face config entries that say nothing about the function the model computes.
HF_VOLATILE = ("transformers_version", "torch_dtype", "dtype", "architectures", "use_cache", "attn_implementation",
               "output_attentions", "output_hidden_states", "return_dict", "tie_encoder_decoder", "pad_token_id",
               "bos_token_id", "eos_token_id")
# Entries Tessera's own keys set on the loaded model: peft.quantization=nf4 gives the base a quantization_config
# (compared as the config key peft.quantization; the config a resumed run describes has none).
HF_SET_BY_KEYS = ("quantization_config",)


def _flatten(node, prefix: str = "") -> Dict[str, object]:
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def changed_values(checkpoint: str, cfg) -> Dict[str, Tuple[object, object]]:
    """{key: (checkpoint's value, this run's value)} for every config key that differs (config.yaml of the
    checkpoint; an older checkpoint without one gives no differences)."""
    from omegaconf import OmegaConf

    path = os.path.join(checkpoint, "config.yaml")
    if not os.path.isfile(path):
        return {}
    saved = _flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=True))
    now = _flatten(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    return {k: (saved.get(k), v) for k, v in now.items()
            if k in saved and saved[k] != v and k not in PER_INVOCATION}


def _hf_differences(checkpoint: str, hf_config) -> List[str]:
    path = os.path.join(checkpoint, "hf_config", "config.json")
    if hf_config is None or not os.path.isfile(path):
        return []
    from transformers import AutoConfig

    try:
        saved = AutoConfig.from_pretrained(os.path.dirname(path)).to_dict()
    except (OSError, ValueError):
        return []
    now = hf_config.to_dict()

    def relevant(k):
        return not k.startswith("_") and k not in HF_VOLATILE + HF_SET_BY_KEYS

    keys = sorted(k for k in set(saved) | set(now) if relevant(k) and saved.get(k) != now.get(k))
    return [f"{k}={saved.get(k)!r} (checkpoint) vs {now.get(k)!r}" for k in keys]


def refusals(checkpoint: str, cfg, hf_config) -> List[str]:
    """Differences a resume cannot carry, each naming its key."""
    problems = []
    changes = changed_values(checkpoint, cfg)
    for key, reason in REFUSED.items():
        if key in changes:
            old, new = changes[key]
            problems.append(f"{key}={new!r} but the checkpoint was trained with {old!r}: {reason}; set it back, or "
                            f"set checkpoint.load_weights_only=true to start a new run from the weights")
    model_keys = sorted(k for k in changes if k.startswith("model.") and k not in MODEL_FREE)
    if model_keys:
        problems.append("the model differs from the checkpoint's: " + ", ".join(
            f"{k}={changes[k][1]!r} (checkpoint: {changes[k][0]!r})" for k in model_keys) + "; set them back")
    hf = _hf_differences(checkpoint, hf_config)
    if hf and not model_keys:
        problems.append(f"the model's config differs from the checkpoint's ({'; '.join(hf[:4])}); resume with the "
                        f"model it was trained with")
    return problems


def apply(checkpoint: str, cfg, optimizer, scheduler, step: int) -> List[str]:
    """After the optimizer and scheduler were restored (at `step`): apply this run's optimizer hyper-parameters
    and schedule, and return one line per change for the log."""
    changes = changed_values(checkpoint, cfg)
    _apply_optimizer(optimizer.param_groups, cfg.optim)
    factor = _apply_schedule(optimizer.param_groups, scheduler, cfg, step)
    return _report(changes, step, cfg.optim.lr, factor)


def _apply_optimizer(groups, o) -> None:
    for i, group in enumerate(groups):
        # Groups say whether they decay (trainer/run/optim.py); a checkpoint saved before they did was built as
        # [decayed matrices, the rest]: the first decays.
        if "weight_decay" in group:
            group["weight_decay"] = o.weight_decay if group.get("decays", i == 0) else 0.0
        group.update(configured_values(group, o))
        group["initial_lr"] = o.lr


def _apply_schedule(groups, scheduler, cfg, step: int) -> float:
    """The schedule recomputed from this run's values at `step`; the lr factor it gives there."""
    s, lr = cfg.scheduler, cfg.optim.lr
    factor = lr_factor(step, s.name, s.warmup_steps, cfg.train.max_steps, s.min_lr_ratio)
    scheduler.base_lrs = [lr] * len(groups)
    for group in groups:
        group["lr"] = lr * factor
    return factor


def _report(changes: Dict[str, Tuple[object, object]], step: int, lr: float, factor: float) -> List[str]:
    lines = []
    for key in OPTIMIZER + SCHEDULE:
        if key in changes:
            old, new = changes[key]
            lines.append(f"{key}: {json.dumps(old)} -> {json.dumps(new)}")
    others = sorted(k for k in changes if k not in OPTIMIZER + SCHEDULE and k not in REFUSED
                    and not k.startswith("model."))
    if lines:
        lines.append(f"the schedule continues at step {step} with peak lr {lr:g}: lr now {lr * factor:.3e}")
    if others:
        lines.append("taken as given: " + ", ".join(f"{k}={changes[k][1]!r}" for k in others))
    return lines
