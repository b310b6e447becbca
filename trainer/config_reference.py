"""Regenerate docs/config.md from the typed schema: `python -m trainer.config_reference [--write | --check]`
(machinery in trainer/config/reference.py)."""
import sys

from trainer.config.reference import main

if __name__ == "__main__":
    sys.exit(main())
