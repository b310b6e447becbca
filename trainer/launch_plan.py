"""For launch.sh: compose the config from the command-line overrides and print which launcher the chosen
strategy needs (python, torchrun or deepspeed). Prints `python` when the overrides don't compose, so the
entry point itself reports the problem once."""
from __future__ import annotations

import os
import sys


def launcher_for(overrides) -> str:
    from hydra import compose, initialize_config_dir

    from trainer.cli import register_resolvers
    from trainer.config import register_configs
    from trainer.strategies import strategy_class

    register_resolvers()
    register_configs()
    conf_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        cfg = compose(config_name="config", overrides=[o for o in overrides if not o.startswith("hydra.")])
    cls = strategy_class(cfg.strategy.name)
    return cls.launcher if cls is not None else "python"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        print(launcher_for(sys.argv[1:]))
    except Exception:  # noqa: BLE001 - any composition problem is reported by the real run
        print("python")
