"""Export a checkpoint as a Hugging Face folder: `python -m trainer.export CHECKPOINT OUT_DIR [--dtype ...]`
(machinery in trainer/exporting/)."""
import sys

from trainer.exporting.from_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
