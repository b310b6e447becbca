"""Build DeepSpeed's C++ ops a ZeRO run loads: `python -m trainer.ds_ops build` (launch.sh runs it at set-up;
machinery in trainer/launch/ds_ops.py)."""
import sys

from trainer.launch.ds_ops import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
