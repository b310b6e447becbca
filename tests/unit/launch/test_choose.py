"""launch.sh's launcher choice (trainer/launch/choose.py): the launcher each strategy class declares, chosen
without importing torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
from trainer.launch import choose
from trainer.strategies import STRATEGIES


def test_every_strategy_has_its_declared_launcher():
    assert set(choose.LAUNCHERS) == set(STRATEGIES)
    for name, cls in STRATEGIES.items():
        assert choose.LAUNCHERS[name] == cls.capabilities.launcher, name


@pytest.mark.parametrize("overrides,expected", [
    (["strategy=single", "train.max_restarts=0"], "python 0"),
    (["strategy=ddp", "train.max_restarts=2"], "torchrun 2"),
    (["strategy=zero2", "train.max_restarts=0"], "deepspeed 0"),
    (["strategy=3d", "train.max_restarts=1"], "torchrun 1"),
    (["strategy=ddp", "strategy.fault_tolerance=torchft", "train.max_restarts=0"], "torchft 0"),
    (["train.max_stepz=1"], "python 0")])
def test_the_choice_composes_the_config_without_torch(overrides, expected):
    code = ("import sys; from trainer.launch.choose import plan_for; print(plan_for(sys.argv[1:])); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, *overrides], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0] == expected
    assert out[1] == "False", "launch.sh's launcher choice imported torch"
