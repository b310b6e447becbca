"""The one compose: conf/ with Hydra's compose API, for the commands that read a config before (or without) the
entry point's @hydra.main: launch.sh's launcher choice, the entry's override check, the planner, tests."""
from __future__ import annotations

import os
import time
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from trainer.config.schema import register_configs

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "conf"


def compose(overrides):
    """The DictConfig that Hydra composes from conf/ and `overrides` (hydra.* overrides left out: they configure
    Hydra, not the run). Composition problems (unknown keys, wrong types) propagate."""
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=[o for o in overrides if not o.startswith("hydra.")])


def launch_time(fmt: str = "%Y-%m-%d/%H-%M-%S") -> str:
    """When this run was launched: the start time of the launcher process (the parent of every local rank,
    so all ranks of a torchrun/deepspeed launch agree) or, for a plain `python` run, now."""
    ts = time.time()
    if "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        ts = process_start_time(os.getppid()) or ts
    if "TESSERA_LAUNCH_TIME" in os.environ:  # set by launch.sh so that everything it starts agrees
        ts = float(os.environ["TESSERA_LAUNCH_TIME"])
    return time.strftime(fmt, time.localtime(ts))


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
