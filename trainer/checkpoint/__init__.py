"""Checkpoints: the manager (atomic, any world size), the resume policy, and weights-only loading of files."""
