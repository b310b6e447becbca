"""torchrun for launch.sh: the same launcher, but a rank that fails ends with its own message and exit code
instead of torchrun's traceback of the failure (the rank already printed what went wrong)."""
from __future__ import annotations

import sys


def main(argv) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        print(f"launch.sh: rank {rank} exited with code {failure.exitcode}; the other ranks were stopped",
              file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
