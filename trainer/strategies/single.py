"""One process, one device: no process group, no wrapping."""
from __future__ import annotations

from trainer.strategies.base import Strategy


class SingleStrategy(Strategy):
    name = "single"
    launcher = "python"
    needs_process_group = False
    holds_whole_model = True

    @classmethod
    def config_problems(cls, cfg, world_size):
        problems = super().config_problems(cfg, world_size)
        if world_size != 1:
            problems.append(f"strategy=single runs one process but the world size is {world_size}; use "
                            f"strategy=ddp (or another parallel strategy), or start one process")
        return problems

    def setup(self, model, build_optimizer, initial_weights=None):
        self.prepare_blocks(model)
        self.load_initial_weights(model, initial_weights)
        self.model = model.to(self.device)
        self.optimizer = build_optimizer(self.model.named_parameters())
        return self.model, self.optimizer
