"""Tessera entry point: compose the config, check it, build, train, close.

    python trainer/main.py [overrides]                          # one process
    torchrun --nproc_per_node 2 trainer/main.py strategy=ddp    # several processes
    deepspeed --num_gpus 2 trainer/main.py strategy=ddp         # the deepspeed launcher works too
    ./launch.sh [overrides]                                     # picks the launcher for you
"""
import os
import sys

# `python trainer/main.py` puts trainer/ first on sys.path, where trainer/tokenize.py (`python -m trainer.tokenize`)
# would shadow the standard library's tokenize module; trainer/ is imported as the package `trainer` only.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

from tessera import import_time  # noqa: E402

import_time.pause_collector()  # until the imports below are done: tessera/import_time.py

from trainer.run.cli import compose_or_exit, hydra_flags, sanitize_argv, user_errors

sys.argv = sanitize_argv(sys.argv)
# The one compose of this process, before the heavy imports: a bad command line ends at once (exit 2). With
# Hydra's own flags (--cfg, --help, -m) @hydra.main composes instead.
JOB = None if hydra_flags(sys.argv) else compose_or_exit(sys.argv)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402

from trainer.config.compose import register_hydra_plugins, register_resolvers, run_job  # noqa: E402
from trainer.config.schema import register_configs, to_object  # noqa: E402
from trainer.launch import sweep  # noqa: E402
from trainer.run import build as B  # noqa: E402
from trainer.run.loop import export_final, fit  # noqa: E402

import_time.freeze_imported()


def train(dcfg) -> None:
    """Check, build, train, export, close: the job Hydra runs on the composed config."""
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


def main() -> None:
    if JOB is not None:
        run_job(train, JOB)
    else:  # @hydra.main composes: the schema and the ${run_name:} resolver first
        register_configs()
        register_resolvers()
        register_hydra_plugins()
        hydra.main(config_path="../conf", config_name="config", version_base=None)(train)()
        if sweep.FINISHED:  # a multirun through hydra/launcher=tessera: 0, or the first failed job's exit code
            sys.exit(sweep.sweep_exit_code(sweep.FINISHED))


if __name__ == "__main__":
    main()
