"""Tokenize once, train many times: `python -m trainer.tokenize OUT_DIR [--workers N] [--shard-range A:B] [--merge]
[overrides]` writes a sharded token store of the data that the same `model=` and `data=` overrides train on
(machinery in trainer/data/tokenizing.py; docs/data.md)."""
import sys

from trainer.data.tokenize_command import main

if __name__ == "__main__":
    sys.exit(main())
