"""Automatic restarts: a launch that fails on a fault starts again and continues the same run.

launch.sh's launchers (trainer/launch/torchrun.py, trainer/launch/deepspeed.py) restart the whole process group up to
`train.max_restarts` times (TESSERA_MAX_RESTARTS, which launch.sh reads from the config) when a rank dies or
fails on a fault: killed by a signal, exit 4 (a lost peer, a timed-out collective, a stalled rank) or an
unexpected crash. Bad input (exit 2), divergence (3) and a user's stop are not retried: they would end the same
way. torchrun used directly restarts with its own `--max-restarts` (its elastic agent: also what re-forms an
elastic job after a node left or joined).

Either way the restarted ranks see their restart count (TESSERA_RESTART_COUNT, or torchrun's
TORCHELASTIC_RESTART_COUNT) and continue the run of their run directory (the resume plan reads the count:
trainer/checkpoint/resume_plan.py `intend`): from its newest complete checkpoint (incomplete ones, from a save
that was killed, are skipped), or from the start when there is none yet. The
deterministic sampler and exact resume make the continued run the same as one never interrupted, and
metrics.jsonl is cut back to the resumed step, so it stays one series.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

from tessera.errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_OK

RESTART_ENV = "TESSERA_RESTART_COUNT"
MAX_ENV = "TESSERA_MAX_RESTARTS"
FINAL = (EXIT_OK, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_INTERRUPTED)  # a restart would end the same way


def restart_count() -> int:
    """How many times this launch restarted the process group before starting this process."""
    for name in (RESTART_ENV, "TORCHELASTIC_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 0


def retryable(code) -> bool:
    return code is not None and code not in FINAL


def max_restarts() -> int:
    value = os.environ.get(MAX_ENV, "0")
    return int(value) if value.isdigit() else 0


def supervise(attempt: Callable[[], int], stopped: Callable[[], bool], label: str) -> int:
    """Run `attempt()` (one launch of the process group; returns its exit code) again after a fault, up to
    TESSERA_MAX_RESTARTS times, unless a user's stop signal arrived."""
    limit, n = max_restarts(), 0
    while True:
        os.environ[RESTART_ENV] = str(n)
        code = attempt()
        if not retryable(code) or stopped() or n >= limit:
            if retryable(code) and limit and n >= limit:
                print(f"{label}: giving up after {limit} restart(s) (train.max_restarts={limit})", file=sys.stderr,
                      flush=True)
            return code
        n += 1
        print(f"{label}: restarting the ranks ({n} of {limit}): they resume from the newest complete checkpoint",
              file=sys.stderr, flush=True)
