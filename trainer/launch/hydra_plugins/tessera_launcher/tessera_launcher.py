"""hydra/launcher=tessera: each job of a multirun is a launch of launch.sh (a distributed job of its own) in
<hydra.sweep.dir>/<job number>; a failed job does not stop the sweep; a summary table ends it (the work is in
trainer/launch/sweep.py; Hydra finds launchers only in the hydra_plugins package)."""

from pathlib import Path
from typing import List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict

from trainer.launch import sweep


# A plain node, not a dataclass: configs that other launchers pickle (submitit) then name no class of this module,
# which their job processes could not import.
ConfigStore.instance().store(group="hydra/launcher", name="tessera", provider="tessera",
                             node={"_target_": "hydra_plugins.tessera_launcher.tessera_launcher.TesseraLauncher"})


class TesseraLauncher(Launcher):
    def __init__(self) -> None:
        self.config: Optional[DictConfig] = None
        self.hydra_context = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        returns: List[JobReturn] = []
        labels = sweep.varying([filter_overrides(list(o)) for o in job_overrides])
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(job_cfg):
                job_cfg.hydra.job.id = job_cfg.hydra.job.num = idx
            run_dir = sweep_dir / str(job_cfg.hydra.sweep.subdir)
            outcome = sweep.run_job(idx, filter_overrides(list(overrides)), run_dir, labels[idx - initial_job_idx])
            sweep.report_job(outcome)
            sweep.FINISHED.append(outcome)
            ret = JobReturn(overrides=list(overrides), cfg=job_cfg, hydra_cfg=self.config, working_dir=str(run_dir),
                            task_name=str(job_cfg.hydra.job.name), status=JobStatus.COMPLETED)
            ret.return_value = outcome.exit_code
            returns.append(ret)
        print(sweep.write_summary(sweep_dir, sweep.FINISHED), flush=True)
        return returns
