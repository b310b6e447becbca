"""trainer/main.py with a pause inside one checkpoint save, so that a test can kill a rank in the middle of it.

    python tests/integration/fault_worker.py --pause-save=STEP:SECONDS [trainer overrides...]
    torchrun --nproc_per_node 2 tests/integration/fault_worker.py --pause-save=12:30 [trainer overrides...]

Every rank sleeps SECONDS in the save of step STEP after the save's small files (meta.json, config.yaml, the
rank's RNG file) are written and before the strategy writes its shards. The fault lives here, not in the
trainer: this script wraps the checkpoint manager's strategy and then runs the real entry point.
"""
import os
import runpy
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = os.path.join(REPO, "trainer", "main.py")
sys.path.insert(0, REPO)

from trainer import checkpoint  # noqa: E402


def pause_in_save(step: int, seconds: float) -> None:
    """Make every CheckpointManager's strategy sleep before writing the shards of step `step`."""
    original_init = checkpoint.CheckpointManager.__init__

    def init(manager, *args, **kwargs):
        original_init(manager, *args, **kwargs)
        save_shards = manager.strategy.save_checkpoint_state

        def paused(folder, *rest, **options):
            if os.path.basename(folder.rstrip("/")) == f"{checkpoint.TMP_PREFIX}{step}":
                time.sleep(seconds)
            return save_shards(folder, *rest, **options)

        manager.strategy.save_checkpoint_state = paused

    checkpoint.CheckpointManager.__init__ = init


def main() -> None:
    flag = "--pause-save="
    pauses = [a for a in sys.argv[1:] if a.startswith(flag)]
    if len(pauses) != 1:
        sys.exit(f"usage: {sys.argv[0]} {flag}STEP:SECONDS [trainer overrides...]")
    step, seconds = pauses[0][len(flag):].split(":")
    pause_in_save(int(step), float(seconds))
    sys.argv = [MAIN] + [a for a in sys.argv[1:] if not a.startswith(flag)]
    runpy.run_path(MAIN, run_name="__main__")


if __name__ == "__main__":
    main()
