"""What the ranks of a job must agree on (trainer/run/agreement.py), judged from their gathered views: the run
directory, the code, the config (the process-group parts run in tests/integration/test_nodes.py)."""
from __future__ import annotations

from trainer.run.agreement import _differences, code_fingerprint, flat_config


def _view(rank, host="a", code="c0", run_dir="/shared/run", **config):
    return {"rank": rank, "host": host, "code": code, "run_dir": run_dir,
            "config": {"optim.lr": "0.001", "strategy.name": "'ddp'", **config}}


def test_agreeing_ranks_pass():
    assert _differences([_view(0), _view(1, host="b")]) == []


def test_another_config_names_the_keys_and_both_values():
    problems = _differences([_view(0), _view(1, host="b"), _view(2, host="b", **{"optim.lr": "0.5"})])
    assert problems == ["rank 2 on b runs another config than rank 0: optim.lr=0.5 (rank 0: 0.001); start every "
                        "node with the same overrides"]


def test_other_code_and_another_run_directory_are_named():
    problems = _differences([_view(0), _view(1, host="b", code="c1")])
    assert len(problems) == 1 and "b (rank 1)" in problems[0] and "different code" in problems[0]
    assert "disagree on the run directory" in _differences([_view(0), _view(1, run_dir="/local/run")])[0]


def test_the_fingerprints_are_stable_and_flat(compose):
    assert code_fingerprint() == code_fingerprint() and len(code_fingerprint()) == 16
    flat = flat_config(compose(["optim.lr=0.5"]))
    assert flat["optim.lr"] == "0.5" and flat["strategy.name"] == "'ddp'" and "train.max_steps" in flat
