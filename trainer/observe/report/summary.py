"""Each run's figures for the report's table, how it ended, and the overrides that differ between runs."""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from trainer.observe.report.runs import Run

# trainer/checkpoint/manager.py's names (not imported: that module loads torch).
CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE.json"
LATEST = "latest"


@dataclass
class Summary:
    steps: Optional[int]  # the last logged step
    tokens: Optional[int]  # target tokens trained by then
    final_loss: Optional[float]  # the last logged training loss (nan: logged as null, non-finite)
    last_val: Optional[float]  # the last evaluation's val_loss
    best_val: Optional[float]  # the lowest finite val_loss
    median_tokens_per_s: Optional[float]
    peak_mem_gib: Optional[float]  # the largest peak_mem_gib logged (CUDA allocated, or rank 0's RSS on CPU)
    model_states_bytes: Optional[int]  # memory.json: the largest rank's model states after step 1
    state: str  # how the run ended, as far as its folder tells


def number(value) -> Optional[float]:
    """A logged value as a float: nan for JSON null (the trainer writes a non-finite number as null), None for
    anything that is not a number."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def finite(values) -> List[float]:
    return [v for v in (number(x) for x in values) if v is not None and math.isfinite(v)]


def val_records(run: Run) -> List[dict]:
    """Every evaluation: eval.jsonl, else the metrics records that carry val_loss."""
    if run.evals:
        return [r for r in run.evals if "val_loss" in r]
    return [r for r in run.metrics if "val_loss" in r]


def summarize(run: Run) -> Summary:
    last = run.metrics[-1] if run.metrics else {}
    vals = val_records(run)
    val_losses = finite(r["val_loss"] for r in vals)
    tok_s = finite(r.get("tokens_per_s") for r in run.metrics if "tokens_per_s" in r)
    mem = finite(r.get("peak_mem_gib") for r in run.metrics if "peak_mem_gib" in r)
    return Summary(steps=last.get("step"), tokens=last.get("tokens"),
                   final_loss=number(last["loss"]) if "loss" in last else None,
                   last_val=number(vals[-1]["val_loss"]) if vals else None,
                   best_val=min(val_losses) if val_losses else None,
                   median_tokens_per_s=statistics.median(tok_s) if tok_s else None,
                   peak_mem_gib=max(mem) if mem else None, model_states_bytes=model_states_bytes(run),
                   state=exit_state(run))


def largest_rank(run: Run) -> Optional[dict]:
    """memory.json's rank that held the most model states (bytes per category), or None without the report."""
    ranks = (run.memory or {}).get("ranks") if isinstance(run.memory, dict) else None
    ranks = [r for r in ranks or [] if isinstance(r, dict) and isinstance(r.get("model_states"), int)]
    return max(ranks, key=lambda r: r["model_states"]) if ranks else None


def model_states_bytes(run: Run) -> Optional[int]:
    rank = largest_rank(run)
    return rank["model_states"] if rank else None


def exit_state(run: Run) -> str:
    """`running`, `failed: nothing logged`, `diverged at step N`, `finished` or `stopped at step N` (a crash, a
    stop or train.max_time_s), then the newest complete checkpoint and whether hf/ was exported."""
    if run.live:
        return "running"
    if not run.metrics:
        return "failed: nothing logged"
    last = run.metrics[-1]
    train = run.config.get("train")
    max_steps = train.get("max_steps") if isinstance(train, dict) else None
    loss = number(last["loss"]) if "loss" in last else None
    if loss is not None and not math.isfinite(loss):
        parts = [f"diverged at step {last['step']}"]
    elif isinstance(max_steps, int) and last["step"] >= max_steps:
        parts = ["finished"]
    else:
        parts = [f"stopped at step {last['step']}"]
    checkpoint = latest_checkpoint(run.path)
    if checkpoint:
        parts.append(f"checkpoint {checkpoint}")
    if os.path.isfile(os.path.join(run.path, "hf", "config.json")):
        parts.append("hf/")
    return ", ".join(parts)


def latest_checkpoint(path: str) -> Optional[str]:
    """The name of the newest complete checkpoint (the `latest` marker moves only after one is complete)."""
    root = os.path.join(path, CHECKPOINTS)
    try:
        with open(os.path.join(root, LATEST)) as fh:
            name = fh.read().strip()
    except OSError:
        return None
    return name if name and os.path.isfile(os.path.join(root, name, COMPLETE)) else None


# ---- overrides ------------------------------------------------------------------------------------------------

def differing_overrides(runs: List[Run]) -> Tuple[List[str], List[Dict[str, str]]]:
    """(the keys whose values differ between the runs, each run's {key: value as shown}). The keys are those of
    the runs' .hydra/overrides.yaml (hydra.* left out); a run without that file adds every key of the resolved
    configs. A run that did not override a key shows its config.yaml value (a group's chosen name), or `-`."""
    parsed = [dict(_override(o) for o in run.overrides or []) for run in runs]
    keys = [k for overrides in parsed for k in overrides if not k.startswith("hydra.")]
    if any(run.overrides is None for run in runs):
        keys += [k for run in runs for k in _flat(run.config)]
    keys = list(dict.fromkeys(keys))
    shown = [{k: overrides[k] if k in overrides else _config_value(run.config, k) for k in keys}
             for run, overrides in zip(runs, parsed)]
    differ = [k for k in keys if len({_comparable(s[k]) for s in shown}) > 1]
    return differ, [{k: s[k] for k in differ} for s in shown]


def _override(text: str) -> Tuple[str, str]:
    key, _, value = text.partition("=")
    return key.lstrip("+~"), value  # `+key=v`, `++key=v`, `~key`: the key itself


def _config_value(config: dict, key: str) -> str:
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "-"
        node = node[part]
    if isinstance(node, dict):  # a config group (strategy=fsdp): the option's name
        node = node.get("name", node.get("kind", "-"))
    return _text(node)


def _flat(config, prefix: str = "") -> List[str]:
    if not isinstance(config, dict):
        return [prefix[:-1]] if prefix else []
    return [k for key, value in config.items() for k in _flat(value, f"{prefix}{key}.")]


def _text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return value if isinstance(value, str) else json.dumps(value)


def _comparable(text: str):
    """A shown value as its type: `false`/`False`, `1e-3`/`0.001`, `'x'`/`x` are the same value."""
    text = text.strip()
    if text.lower() in ("true", "false"):
        return ("bool", text.lower() == "true")
    for kind in (int, float):
        try:
            return ("number", kind(text))
        except ValueError:
            pass
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return ("text", "null" if text.lower() in ("null", "none") else text)
