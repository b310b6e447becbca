"""DeepSpeed's runner (`deepspeed.launcher.runner`) in a process that imports `trainer` first, so DeepSpeed's
import skips mlflow (tessera/import_time.py): `python -m trainer.launch.deepspeed_runner [runner arguments]`,
started by trainer/launch/deepspeed.py."""
import sys

import trainer  # noqa: F401 - installs the import-time finder
from tessera import import_time

if __name__ == "__main__":
    sys.argv[0] = "deepspeed"  # the runner's usage line names the command users know
    with import_time.imports_frozen():
        from deepspeed.launcher.runner import main  # what `python -m deepspeed.launcher.runner` runs
    main()
