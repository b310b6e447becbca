"""Compare runs: `python -m trainer.report RUN_DIR [RUN_DIR ...] [--out DIR]` writes one PNG figure per quantity and
report.md, a table of the runs (machinery in trainer/observe/report/; docs/report.md)."""
import sys

from trainer.observe.report.command import main

if __name__ == "__main__":
    sys.exit(main())
