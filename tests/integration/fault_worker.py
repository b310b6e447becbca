"""trainer/main.py with a fault a test cannot cause from outside: a pause inside one checkpoint save (so that
a test can kill a rank in the middle of it), or a hang outside any collective.

    python tests/integration/fault_worker.py --pause-save=STEP:SECONDS [trainer overrides...]
    torchrun --nproc_per_node 2 tests/integration/fault_worker.py --pause-save=12:30 [trainer overrides...]
    torchrun --nproc_per_node 2 tests/integration/fault_worker.py --hang-after=5 [trainer overrides...]
    torchrun --nproc_per_node 1 tests/integration/fault_worker.py --step-delay=0.2 [trainer overrides...]
    torchrun --nproc_per_node 2 tests/integration/fault_worker.py --freeze=save:6:1 [trainer overrides...]

Every rank sleeps SECONDS in the save of step STEP after the save's small files (meta.json, config.yaml, the
rank's RNG file) are written and before the strategy writes its shards; only in the first attempt of a launch
(a restarted launch saves without pausing). The fault lives here, not in the
trainer: this script wraps the checkpoint manager's strategy and then runs the real entry point.

With --step-delay=SECONDS every rank sleeps that long after each step, in every attempt: a slow run that a
test can act on while it trains (fault-tolerant replica groups losing and regaining a group).

With --hang-after=STEP every rank sleeps (for good) after step STEP, in the loop but in no collective, as a
rank stuck on a file system or in a data loader would: only the progress watchdog can end that. First attempt
only, too.

With --freeze=PHASE:STEP:RANK rank RANK stops itself (SIGSTOP, as a frozen node or a debugger would) in PHASE:
`save` inside the checkpoint save of step STEP (before writing its shards), `eval` as the evaluation after step
STEP begins, `step` in the forward of step STEP. First attempt only.
"""
import os
import runpy
import signal
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = os.path.join(REPO, "trainer", "main.py")
sys.path.insert(0, REPO)

from tessera import import_time  # noqa: E402

import_time.pause_collector()  # trainer/main.py freezes the imports (tessera/import_time.py)
from trainer.checkpoint import manager as checkpoint  # noqa: E402

from trainer.launch import restarts  # noqa: E402


def pause_in_save(step: int, seconds: float) -> None:
    """Make every CheckpointManager's strategy sleep before writing the shards of step `step`."""
    original_init = checkpoint.CheckpointManager.__init__

    def init(manager, *args, **kwargs):
        original_init(manager, *args, **kwargs)
        save_shards = manager.strategy.save_checkpoint_state

        def paused(folder, *rest, **options):
            if os.path.basename(folder.rstrip("/")) == f"{checkpoint.TMP_PREFIX}{step}" and \
                    restarts.restart_count() == 0:
                time.sleep(seconds)
            return save_shards(folder, *rest, **options)

        manager.strategy.save_checkpoint_state = paused

    checkpoint.CheckpointManager.__init__ = init


def hang_after(step: int) -> None:
    """Make every rank sleep for good after finishing step `step` (outside any collective)."""
    original_poll = checkpoint.CheckpointManager.poll

    def poll(manager):
        if manager.progress.step == step and restarts.restart_count() == 0:
            time.sleep(10**6)
        return original_poll(manager)

    checkpoint.CheckpointManager.poll = poll


def step_delay(seconds: float) -> None:
    """Make every rank sleep `seconds` after each step."""
    original_poll = checkpoint.CheckpointManager.poll

    def poll(manager):
        time.sleep(seconds)
        return original_poll(manager)

    checkpoint.CheckpointManager.poll = poll


def freeze(phase: str, step: int, rank: int) -> None:
    """Make rank `rank` SIGSTOP itself in `phase` (save / eval / step) of step `step`."""
    from trainer.run import loop

    def stop_here(at_step: int) -> None:
        if at_step == step and int(os.environ.get("RANK", "0")) == rank and restarts.restart_count() == 0:
            os.kill(os.getpid(), signal.SIGSTOP)

    original_init, original_evaluate = checkpoint.CheckpointManager.__init__, loop.evaluate

    def init(manager, *args, **kwargs):
        original_init(manager, *args, **kwargs)
        strategy, save_shards, forward_backward = manager.strategy, manager.strategy.save_checkpoint_state, \
            manager.strategy.forward_backward

        def save(folder, *rest, **options):
            if phase == "save":
                stop_here(int(os.path.basename(folder.rstrip("/"))[len(checkpoint.TMP_PREFIX):]))
            return save_shards(folder, *rest, **options)

        def step_forward(*args, **kwargs):
            if phase == "step":
                stop_here(manager.progress.step + 1)
            return forward_backward(*args, **kwargs)

        strategy.save_checkpoint_state, strategy.forward_backward = save, step_forward

    def evaluate(run):
        if phase == "eval":
            stop_here(run.step)
        return original_evaluate(run)

    checkpoint.CheckpointManager.__init__, loop.evaluate = init, evaluate


def main() -> None:
    faults = [a for a in sys.argv[1:] if a.startswith(("--pause-save=", "--hang-after=", "--step-delay=",
                                                        "--freeze="))]
    if len(faults) != 1:
        sys.exit(f"usage: {sys.argv[0]} --pause-save=STEP:SECONDS|--hang-after=STEP|--step-delay=SECONDS|"
                 f"--freeze=PHASE:STEP:RANK [trainer overrides...]")
    flag, value = faults[0].split("=", 1)
    if flag == "--freeze":
        phase, step, rank = value.split(":")
        freeze(phase, int(step), int(rank))
    elif flag == "--pause-save":
        step, seconds = value.split(":")
        pause_in_save(int(step), float(seconds))
    elif flag == "--step-delay":
        step_delay(float(value))
    else:
        hang_after(int(value))
    sys.argv = [MAIN] + [a for a in sys.argv[1:] if a != faults[0]]
    runpy.run_path(MAIN, run_name="__main__")


if __name__ == "__main__":
    main()
