"""Training objectives as pure functions of per-sequence log-probabilities (no configuration, no distribution)."""
