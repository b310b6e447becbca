"""For the report's tests: hand-made run directories (the files the trainer writes, with chosen values), and
report.md's table read back."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml


def write_run(path: Path, metrics=None, evals=None, config=None, overrides=None, memory=None) -> Path:
    """A run directory with metrics.jsonl / eval.jsonl (lists of records), config.yaml and .hydra/ (dicts, the
    overrides a list of `key=value`), memory.json; None leaves a file out."""
    path.mkdir(parents=True, exist_ok=True)
    for name, records in (("metrics.jsonl", metrics), ("eval.jsonl", evals)):
        if records is not None:
            (path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(config))
    if overrides is not None:
        (path / ".hydra").mkdir(exist_ok=True)
        (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    if memory is not None:
        (path / "memory.json").write_text(json.dumps(memory))
    return path


def records(steps=4, lr=1e-3, loss0=5.0, tokens_per_step=512, **extra):
    """metrics.jsonl records of `steps` steps, loss falling, tokens/s and peak memory varying."""
    return [{"step": s, "loss": loss0 - 0.25 * s, "lr": lr, "grad_norm": 1.0 + s, "tokens": s * tokens_per_step,
             "tokens_per_s": 1000.0 * (1 + s % 3), "peak_mem_gib": 0.5 + 0.1 * s, **extra} for s in range(1, steps + 1)]


def config(max_steps=4, lr=1e-3, strategy="single"):
    return {"train": {"max_steps": max_steps}, "optim": {"name": "adamw", "lr": lr},
            "strategy": {"name": strategy, "tp": 1}, "export": {"hf_at_end": False}}


def memory(*model_states):
    return {"world_size": len(model_states), "ranks": [
        {"rank": i, "params": m // 4, "grads": m // 4, "optimizer": m // 2, "master_params": 0, "gathered": 0,
         "model_states": m} for i, m in enumerate(model_states)]}


def table_rows(report_md: str) -> list:
    """report.md's table as {column: cell} per run (override columns without their backticks), the run cell's
    link text only."""
    lines = [line for line in report_md.splitlines() if line.startswith("| ")]
    split = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]
    header = [h.strip("`") for h in split[0]]
    rows = [dict(zip(header, cells)) for cells in split[2:]]
    for row in rows:
        row["run"] = re.fullmatch(r"\[(.*)\]\((.*)\)", row["run"]).group(1)
    return rows
