"""Hydra multirun of distributed jobs (`./launch.sh -m optim.lr=1e-3,3e-4 strategy=ddp`, or `python trainer/main.py
-m ...`): the `tessera` launcher (hydra_plugins/tessera_launcher, the default hydra/launcher) runs each point of
the sweep as its own launch of launch.sh (which picks torchrun, deepspeed or python for that point's strategy) in its
own run directory `<hydra.sweep.dir>/<job number>`, one after the other, goes on past a job that failed, and ends with
a summary table (printed, and summary.md / summary.json in the sweep directory). The sweep's exit code is 0 when
every job finished, else the first failed job's code."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from trainer.config.compose import REPO
from trainer.observe.report.runs import read_run
from trainer.observe.report.summary import summarize

LAUNCH_SH = REPO / "launch.sh"
SUMMARY_MD, SUMMARY_JSON = "summary.md", "summary.json"
# The jobs this process ran (every batch of the sweep): the summary covers them all, and trainer/main.py exits with
# sweep_exit_code(FINISHED) once Hydra's multirun returns.
FINISHED: List["JobOutcome"] = []


def varying(job_overrides: Sequence[Sequence[str]]) -> List[List[str]]:
    """Each job's overrides that the sweep varies (the same in every job: left out; one job: all of them)."""
    values = {}
    for overrides in job_overrides:
        for text in overrides:
            key, _, value = text.partition("=")
            values.setdefault(key, set()).add(value)
    keep = {k for k, v in values.items() if len(v) > 1 or len(job_overrides) == 1}
    return [[t for t in overrides if t.partition("=")[0] in keep] for overrides in job_overrides]


@dataclass
class JobOutcome:
    job: int
    overrides: List[str]  # what the sweep varies in this job
    run_dir: str
    exit_code: int
    seconds: float
    final_loss: Optional[float] = None
    val_loss: Optional[float] = None
    tokens_per_s: Optional[float] = None

    @property
    def status(self) -> str:
        return "finished" if self.exit_code == 0 else f"failed (exit {self.exit_code})"


def run_job(job: int, overrides: Sequence[str], run_dir: Path, label: Sequence[str]) -> JobOutcome:
    """One point of the sweep through launch.sh; its output goes to <run dir>/launch.log. `label`: the overrides
    that name it in the summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_LAUNCH_TIME"}  # each job is a launch of its own
    t0 = time.perf_counter()
    with open(run_dir / "launch.log", "w") as log:
        proc = subprocess.run([str(LAUNCH_SH), *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    outcome = JobOutcome(job, list(label), str(run_dir), proc.returncode, time.perf_counter() - t0)
    if (run_dir / "metrics.jsonl").is_file():
        summary = summarize(read_run(str(run_dir), str(job)))
        outcome.final_loss, outcome.val_loss = summary.final_loss, summary.last_val
        outcome.tokens_per_s = summary.median_tokens_per_s
    return outcome


def _number(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def summary_table(outcomes: List[JobOutcome]) -> str:
    rows = ["| job | overrides | exit status | final loss | val loss | tokens/s | seconds |",
            "| ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    for o in outcomes:
        rows.append(f"| {o.job} | `{' '.join(o.overrides) or '(none)'}` | {o.status} | {_number(o.final_loss, '.4f')} "
                    f"| {_number(o.val_loss, '.4f')} | {_number(o.tokens_per_s, '.0f')} | {o.seconds:.0f} |")
    return "\n".join(rows) + "\n"


def write_summary(sweep_dir: Path, outcomes: List[JobOutcome]) -> str:
    """summary.md and summary.json in the sweep directory (each written whole, then renamed into place)."""
    table = summary_table(outcomes)
    for name, text in ((SUMMARY_MD, f"# Sweep {sweep_dir}\n\n{table}"),
                       (SUMMARY_JSON, json.dumps([dict(asdict(o), status=o.status) for o in outcomes], indent=1))):
        tmp = sweep_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, sweep_dir / name)
    return table


def sweep_exit_code(outcomes: List[JobOutcome]) -> int:
    return next((o.exit_code for o in outcomes if o.exit_code != 0), 0)


def report_job(outcome: JobOutcome) -> None:
    print(f"[sweep] job {outcome.job} ({' '.join(outcome.overrides)}): {outcome.status}, final loss "
          f"{_number(outcome.final_loss, '.4f')}, {outcome.seconds:.0f}s; log {outcome.run_dir}/launch.log",
          file=sys.stderr, flush=True)
