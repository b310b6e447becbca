"""Faults: preemption and stop signals, the stalled-rank watchdog, the divergence guard, and the run directory's
ownership."""
