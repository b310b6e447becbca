"""Tessera's Hydra launcher (hydra/launcher=tessera, the default of conf/config.yaml): trainer/launch/sweep.py."""
