"""Preflight planner: `python -m trainer.plan <overrides>` prints memory and feasibility before launch (machinery in
trainer/planner/)."""
import sys

from trainer.planner.estimate import main

if __name__ == "__main__":
    sys.exit(main())
