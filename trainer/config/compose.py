"""The one compose per process: conf/ with Hydra, for the entry point (`compose_job`, then `run_job` runs the
training as Hydra runs a job) and for the commands that read a config without training (`compose`: launch.sh's
launcher choice, the planner, the exporter, tests)."""
from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.callbacks import Callbacks
from hydra.core.global_hydra import GlobalHydra
from hydra.core.utils import run_job as hydra_run_job
from hydra.types import HydraContext, RunMode
from omegaconf import DictConfig, OmegaConf

from trainer.config.schema import register_configs

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "conf"
# Hydra finds launchers only in the `hydra_plugins` namespace: Tessera's (hydra/launcher=tessera, the default) lives
# in trainer/launch/hydra_plugins/tessera_launcher and joins that namespace before Hydra first scans it.
PLUGINS_DIR = str(REPO / "trainer" / "launch" / "hydra_plugins")


def register_hydra_plugins() -> None:
    try:
        import hydra_plugins  # a namespace that installed Hydra plugins may (or may not) provide
    except ImportError:
        hydra_plugins = sys.modules.setdefault("hydra_plugins", types.ModuleType("hydra_plugins"))
        hydra_plugins.__path__ = []
    if PLUGINS_DIR not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(PLUGINS_DIR)


def compose(overrides):
    """The DictConfig that Hydra composes from conf/ and `overrides` (hydra.* overrides left out: they configure
    Hydra, not the run). Composition problems (unknown keys, wrong types) propagate."""
    register_configs()
    register_resolvers()
    register_hydra_plugins()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=[o for o in overrides if not o.startswith("hydra.")])


def compose_job(overrides) -> DictConfig:
    """The entry point's one compose: conf/ with every override (hydra.* too) and Hydra's own node, exactly as
    @hydra.main composes a plain run (the job is called "main", after trainer/main.py). Problems propagate."""
    register_configs()
    register_resolvers()
    register_hydra_plugins()
    with initialize_config_dir(config_dir=str(CONF_DIR), job_name="main", version_base=None):
        # hydra.mode=RUN: what @hydra.main adds for a run without -m (a sweep goes through @hydra.main itself)
        return GlobalHydra.instance().hydra.compose_config("config", list(overrides) + ["hydra.mode=RUN"],
                                                           run_mode=RunMode.RUN, with_log_configuration=True)


def run_job(task, cfg: DictConfig):
    """Run `task` on `cfg` (from compose_job) as Hydra's own run does after its compose: the run directory
    (hydra.run.dir), its .hydra/ record, logging and HydraConfig for the task, Hydra's callbacks around it.
    Returns the task's value; an exception it raised is raised again."""
    with initialize_config_dir(config_dir=str(CONF_DIR), job_name="main", version_base=None):
        callbacks = Callbacks(cfg)
        callbacks.on_run_start(config=cfg, config_name="config")
        context = HydraContext(config_loader=GlobalHydra.instance().config_loader(), callbacks=callbacks)
        ret = hydra_run_job(task_function=task, config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None,
                            hydra_context=context, configure_logging=True)
        callbacks.on_run_end(config=cfg, config_name="config", job_return=ret)
    return ret.return_value


def launch_time(fmt: str = "%Y-%m-%d/%H-%M-%S") -> str:
    """When this run was launched: the start time of the launcher process (the parent of every local rank,
    so all ranks of a torchrun/deepspeed launch agree) or, for a plain `python` run, now."""
    ts = time.time()
    if "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        ts = process_start_time(os.getppid()) or ts
    if "TESSERA_LAUNCH_TIME" in os.environ:  # set by launch.sh so that everything it starts agrees
        ts = float(os.environ["TESSERA_LAUNCH_TIME"])
    return time.strftime(fmt, time.localtime(ts))


def run_name() -> str:
    """The default run folder's name (conf/config.yaml: outputs/${run_name:}): inside a SLURM job the job's own
    (slurm-<job id>, an array task slurm-<array job>_<task>), the same on every node and after a requeue, so that
    the requeued job continues its run; elsewhere the launch time."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    return launch_time()


def process_start_time(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/stat") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("launch_time"):
        OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True)
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", run_name, use_cache=True)
