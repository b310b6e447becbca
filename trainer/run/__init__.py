"""The run: the composition root (build), the strategy-free loop, optimizers, precision policies, and the entry's
command-line handling (cli)."""
