"""Strategy registry: `strategy.name` -> class. Each strategy is one file."""
from __future__ import annotations

from trainer.strategies.ddp import DDPStrategy
from trainer.strategies.single import SingleStrategy

STRATEGIES = {cls.name: cls for cls in (SingleStrategy, DDPStrategy)}


def strategy_class(name: str):
    return STRATEGIES.get(name)
