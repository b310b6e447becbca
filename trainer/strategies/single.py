"""One process, one device: no process group, no wrapping."""
from __future__ import annotations

from trainer.strategies.base import Strategy
from trainer.strategies.capabilities import Capabilities


class SingleStrategy(Strategy):
    name = "single"
    capabilities = Capabilities(launcher="python", needs_process_group=False, holds_whole_model=True)

    @classmethod
    def layout_problems(cls, cfg, world_size):
        if world_size != 1:
            return [f"strategy=single runs one process but the world size is {world_size}; use strategy=ddp (or "
                    f"another parallel strategy), or start one process"]
        return []

    def setup(self, model, build_optimizer, initial_weights=None):
        self.prepare_blocks(model)
        self.load_initial_weights(model, initial_weights)
        self.model = model.to(self.device)
        self.optimizer = build_optimizer(self.model.named_parameters())
        return self.model, self.optimizer
