"""Parity check: `python -m trainer.parity <overrides> --against <overrides> [--steps N] [--out DIR] [--tolerance T]`
runs the same config under two settings and compares every step's loss and gradient norm (machinery in
trainer/observe/parity/; docs/parity.md)."""
import sys

from trainer.observe.parity.command import main

if __name__ == "__main__":
    sys.exit(main())
