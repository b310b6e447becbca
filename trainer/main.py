"""Tessera entry point: compose the config, check it, build, train, close.

    python trainer/main.py [overrides]                          # one process
    torchrun --nproc_per_node 2 trainer/main.py strategy=ddp    # several processes
    deepspeed --num_gpus 2 trainer/main.py strategy=ddp         # the deepspeed launcher works too
    ./launch.sh [overrides]                                     # picks the launcher for you
"""
import sys

from trainer.config.compose import register_resolvers
from trainer.run.cli import check_overrides, sanitize_argv, user_errors

sys.argv = sanitize_argv(sys.argv)
register_resolvers()
check_overrides(sys.argv)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402

from trainer.run import build as B  # noqa: E402
from trainer.config.schema import register_configs, to_object  # noqa: E402
from trainer.run.loop import export_final, fit  # noqa: E402

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(dcfg) -> None:
    with user_errors():
        prepared = B.prepare(to_object(dcfg), HydraConfig.get().runtime.output_dir)
        run, finished = None, False
        try:
            run = B.build(prepared)
            fit(run)
            export_final(run)
            finished = True
        finally:
            B.close(run, graceful=finished)


if __name__ == "__main__":
    main()
