"""Automatic restarts (trainer/launch/restarts.py) without a launch: which exits are retried, how often, and what a
restarted rank resumes from."""
from __future__ import annotations

import os

import pytest

from tessera.errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_FAULT, EXIT_INTERRUPTED
from trainer.launch import choose as launch_plan
from trainer.checkpoint import resume_plan
from trainer.launch import restarts


@pytest.mark.parametrize("code,retried", [(EXIT_FAULT, True), (1, True), (247, True), (-9, True), (0, False),
                                          (EXIT_BAD_INPUT, False), (EXIT_DIVERGED, False),
                                          (EXIT_INTERRUPTED, False)])
def test_only_faults_are_retried(code, retried):
    assert restarts.retryable(code) is retried


def _supervise(codes, limit, monkeypatch, capsys, stop_after=None):
    monkeypatch.setenv(restarts.MAX_ENV, str(limit))
    seen = []

    def attempt():
        seen.append(int(os.environ[restarts.RESTART_ENV]))
        return codes[len(seen) - 1]

    code = restarts.supervise(attempt, lambda: stop_after is not None and len(seen) >= stop_after, "launch.sh")
    return code, seen, capsys.readouterr().err


def test_a_fault_restarts_until_success(monkeypatch, capsys):
    code, seen, err = _supervise([EXIT_FAULT, 247, 0], 3, monkeypatch, capsys)
    assert code == 0 and seen == [0, 1, 2]  # each attempt's ranks see their restart count
    assert "restarting the ranks (1 of 3)" in err and "restarting the ranks (2 of 3)" in err


def test_restarts_are_bounded_and_the_last_fault_is_the_exit(monkeypatch, capsys):
    code, seen, err = _supervise([EXIT_FAULT] * 5, 2, monkeypatch, capsys)
    assert code == EXIT_FAULT and seen == [0, 1, 2]
    assert "giving up after 2 restart(s) (train.max_restarts=2)" in err


@pytest.mark.parametrize("final", [EXIT_BAD_INPUT, EXIT_DIVERGED])
def test_bad_input_and_divergence_are_not_retried(final, monkeypatch, capsys):
    code, seen, err = _supervise([final, 0], 3, monkeypatch, capsys)
    assert code == final and seen == [0] and "restarting" not in err


def test_a_users_stop_is_not_retried(monkeypatch, capsys):
    code, seen, _ = _supervise([EXIT_FAULT, 0], 3, monkeypatch, capsys, stop_after=1)
    assert code == EXIT_FAULT and seen == [0]


def _fake_checkpoint(run_dir, step):
    folder = run_dir / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "COMPLETE.json").write_text("{}")


@pytest.mark.parametrize("env", ["TESSERA_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"])
def test_a_restarted_rank_continues_its_run(compose, tmp_path, monkeypatch, env):
    monkeypatch.delenv("TESSERA_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    said = []
    cfg = compose(["checkpoint.resume=/elsewhere/step_3", "checkpoint.load_weights_only=true"])

    def plan():
        return resume_plan.intend(cfg, str(tmp_path), restarts.restart_count(), said.append)

    first = plan()  # the first attempt: as asked
    assert (first.mode, first.spec, first.weights_only) == ("path", "/elsewhere/step_3", True) and not said
    monkeypatch.setenv(env, "1")
    again = plan()  # restarted, nothing saved yet: as asked again
    assert (again.mode, again.spec, again.weights_only) == ("path", "/elsewhere/step_3", True)
    _fake_checkpoint(tmp_path, 4)
    _fake_checkpoint(tmp_path, 8)
    own = plan()  # its own checkpoints now: the newest, fully
    assert (own.mode, own.weights_only, own.continues_run) == ("auto", False, True)
    assert said[-1] == f"restart 1: continuing the run in {tmp_path} from its checkpoint of step 8"
    # the config is read, never written: what the user asked for stays in it
    assert cfg.checkpoint.resume == "/elsewhere/step_3" and cfg.checkpoint.load_weights_only
    fresh = resume_plan.intend(compose([]), str(tmp_path / "new"), 1, said.append)  # resume=none: from step 0
    assert fresh.mode == "auto" and said[-1].endswith("from step 0 (no complete checkpoint yet)")


def test_launch_sh_gets_the_launcher_and_the_restarts():
    assert launch_plan.plan_for(["strategy=ddp"]) == "torchrun 3"
    assert launch_plan.plan_for(["strategy=zero2", "train.max_restarts=0"]) == "deepspeed 0"
    assert launch_plan.plan_for(["strategy=single"]) == "python 3"  # trainer/launch/single.py restarts it
    assert launch_plan.plan_for(["no_such_key=1"]) == "python 0"  # the entry point reports it
