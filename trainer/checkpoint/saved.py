"""A complete checkpoint as the checkpoint manager hands it to the strategy that loads it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SavedCheckpoint:
    """What a strategy needs to load a complete checkpoint, read by the checkpoint manager from its meta.json."""
    folder: str
    weights_only: bool  # the model's weights alone (a new run starts from them)
    param_groups: list  # the optimizer's saved param groups (hyper-parameters per group, rank 0's names)
    dp_size: Optional[int]  # the data-parallel size that saved it (None: not recorded)
    scratch_dir: str  # a folder beside the checkpoints for conversions the strategy may need


def groups_by_name(saved: list, mine: list) -> list:
    """The saved optimizer param groups' hyper-parameters under this rank's parameter names (`mine`). Rank 0 wrote
    the groups with its own names; where ranks hold different parameters (pipeline stages) a group is matched by a
    shared name, else as a group of the same optimizer (the same hyper-parameter keys: Muon's or its AdamW's) that
    decays as it does (older checkpoints: the same weight decay)."""
    out = []
    for group in mine:
        names = set(group["params"])
        match = next((g for g in saved if names & set(g["params"])), None)
        if match is None:
            match = next((g for g in saved if _keys(g) == _keys(group) and _same_decay(g, group)), group)
        out.append(dict(match, params=list(group["params"])))
    return out


def _keys(group: dict) -> set:
    return set(group) - {"decays"}


def _same_decay(saved: dict, mine: dict) -> bool:
    if "decays" in saved and "decays" in mine:
        return saved["decays"] == mine["decays"]
    return saved.get("weight_decay") == mine.get("weight_decay")
