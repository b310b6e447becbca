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
