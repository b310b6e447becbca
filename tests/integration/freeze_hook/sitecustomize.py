"""Put this folder on PYTHONPATH with TESSERA_TEST_FREEZE=PHASE:STEP:RANK set, and every rank a launcher starts
(launch.sh, torchrun, deepspeed: each runs the real trainer/main.py) arms fault_worker.freeze before the entry
point runs: rank RANK stops itself (SIGSTOP) in PHASE of step STEP. Launchers and other processes (no RANK in their
environment) are untouched."""
import os
import sys

if os.environ.get("TESSERA_TEST_FREEZE") and "RANK" in os.environ and "LOCAL_RANK" in os.environ:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fault_worker import freeze  # noqa: E402

    phase, step, rank = os.environ["TESSERA_TEST_FREEZE"].split(":")
    freeze(phase, int(step), int(rank))
