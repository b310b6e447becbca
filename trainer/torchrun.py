"""torchrun with Tessera's exits: `python -m trainer.torchrun <torchrun args> trainer/main.py <overrides>` (what
launch.sh runs; machinery in trainer/launch/torchrun.py)."""
import sys

from trainer.launch.torchrun import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
