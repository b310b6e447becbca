"""Strategy registry: `strategy.name` -> class. Each strategy is one file; a class may serve several names
(the ZeRO stages)."""
from __future__ import annotations

from trainer.strategies.ddp import DDPStrategy
from trainer.strategies.deepspeed import DeepSpeedStrategy
from trainer.strategies.single import SingleStrategy
from trainer.strategies.torch_native import TorchNativeStrategy

STRATEGIES = {}
for _cls in (SingleStrategy, DDPStrategy, DeepSpeedStrategy, TorchNativeStrategy):
    for _name in getattr(_cls, "names", None) or (_cls.name,):
        if _name in STRATEGIES:
            raise ValueError(f"strategy name {_name!r} is registered twice")
        STRATEGIES[_name] = _cls


def strategy_class(name: str):
    return STRATEGIES.get(name)
