"""`python -m trainer.parity`: the same config for N steps under two settings (layout, launcher, world size or
precision), compared step by step (docs/parity.md). command.py is the command; sides.py turns the command line into
two comparable runs, shrink.py the debug-size model, runs.py launches them, compare.py judges them and output.py
writes the table, parity.md / parity.json and the figure."""
