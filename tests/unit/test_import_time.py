"""tessera/import_time.py: DeepSpeed imported by a Tessera process leaves mlflow out (1.5 s of start-up), and mlflow
still imports for whoever uses it (the experiment trackers)."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import sys, time
{first}
t0 = time.process_time()
import deepspeed
from deepspeed.autotuning import autotuner
print('RESULT', autotuner.has_mlflow, 'mlflow' in sys.modules, round(time.process_time() - t0, 2))
import mlflow
print('RESULT', mlflow.__name__)
"""


def run(first: str) -> list:
    proc = subprocess.run([sys.executable, "-c", CHECK.format(first=first)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith('RESULT ')]
    return lines[0] + lines[1]  # DeepSpeed's own warnings go to stdout too


def test_deepspeed_imports_without_mlflow_in_a_tessera_process_and_mlflow_still_imports():
    pytest.importorskip("mlflow")
    has_mlflow, loaded, _, name = run("import trainer")
    assert (has_mlflow, loaded, name) == ("False", "False", "mlflow")


def test_without_tessera_the_autotuner_imports_mlflow():
    """The finder is what makes the difference (if DeepSpeed stops importing mlflow, this fails: drop the module)."""
    pytest.importorskip("mlflow")
    has_mlflow, loaded, _, _ = run("")
    assert (has_mlflow, loaded) == ("True", "True")


def test_the_deepspeed_runner_runs_under_tessera_and_answers_help():
    proc = subprocess.run([sys.executable, "-m", "trainer.launch.deepspeed_runner", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage: deepspeed [-h]" in proc.stdout, proc.stdout[:300]


FROZEN = """
import gc, runpy, sys
sys.argv = ["trainer/main.py", "--cfg", "job"]  # Hydra's own flag: the entry composes nothing at import
runpy.run_path("trainer/main.py", run_name="imported")  # the module's top level: its imports, not main()
print("RESULT", gc.isenabled(), gc.get_freeze_count(), len(gc.get_objects()))
"""


def test_the_entry_freezes_what_it_imported_and_collects_what_comes_after():
    """trainer/main.py pauses the cyclic collector for its imports and freezes them (tessera/import_time.py): the
    hundreds of thousands of objects of torch and transformers are out of every later collection's walk, and
    the collector runs again for what the run allocates."""
    proc = subprocess.run([sys.executable, "-c", FROZEN], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    enabled, frozen, tracked = next(line.split()[1:] for line in proc.stdout.splitlines()
                                    if line.startswith("RESULT "))
    assert enabled == "True"
    assert int(frozen) > 200_000 and int(tracked) < int(frozen) // 10, (frozen, tracked)


def test_pause_and_freeze_leave_later_garbage_collectable():
    code = """
import gc
from tessera import import_time
import_time.pause_collector()
assert not gc.isenabled()
import json, email.parser  # some imports
import_time.freeze_imported()
assert gc.isenabled() and gc.get_freeze_count() > 0
with import_time.imports_frozen():
    assert not gc.isenabled()
assert gc.isenabled()
class Node: pass
a, b = Node(), Node(); a.other, b.other = b, a  # a cycle allocated after the freeze
del a, b
print("RESULT", gc.collect() >= 2)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT True" in proc.stdout
