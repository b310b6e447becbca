"""The resume plan (trainer/checkpoint/resume_plan.py): checkpoint.resume read once into a frozen object, and the
train state (trainer/run/state.py) as Stateful objects the checkpoint manager saves by name."""
from __future__ import annotations

import ast
import dataclasses
import json
import pathlib

import pytest
from torch.distributed.checkpoint.stateful import Stateful

from trainer.checkpoint import resume_plan
from trainer.run.state import DataPosition, RandomState, TrainState

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_the_modes_and_who_continues_the_run(tmp_path):
    d = str(tmp_path)
    none = resume_plan.plan_for("none", False, d)
    auto = resume_plan.plan_for("auto", False, d)
    inside = resume_plan.plan_for(str(tmp_path / "checkpoints" / "step_2"), False, d)
    weights = resume_plan.plan_for("/elsewhere/step_2", True, d)
    assert (none.mode, auto.mode, inside.mode, weights.mode) == ("none", "auto", "path", "path")
    assert [p.continues_run for p in (none, auto, inside, weights)] == [False, True, True, False]
    assert not none.appends_logs and auto.appends_logs and auto.falls_back and not inside.falls_back
    assert weights.describe() == "checkpoint.resume=/elsewhere/step_2 with checkpoint.load_weights_only=true"
    with pytest.raises(dataclasses.FrozenInstanceError):
        auto.path = "x"


def test_auto_without_checkpoints_starts_at_step_0(tmp_path):
    said = []
    plan = resume_plan.choose(resume_plan.plan_for("auto", False, str(tmp_path)), str(tmp_path),
                              lambda path, meta: [], 10, said.append)
    assert plan.path is None and not plan.full and said[-1].endswith("starting at step 0")


def _checkpoint(run_dir, step):
    folder = run_dir / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": step}))
    (folder / "COMPLETE.json").write_text(json.dumps({"step": step, "files": {}}))
    return str(folder)


def test_auto_picks_the_newest_and_keeps_the_older_as_fallbacks(tmp_path):
    older, newer = _checkpoint(tmp_path, 4), _checkpoint(tmp_path, 8)
    asked = []
    plan = resume_plan.choose(resume_plan.plan_for("auto", False, str(tmp_path)), str(tmp_path),
                              lambda path, meta: asked.append(meta["step"]) or [], 10, print)
    assert (plan.path, plan.fallbacks, plan.full) == (newer, (older,), True) and asked == [8, 4]
    with pytest.raises(resume_plan.ckpt.CheckpointError, match="already reaches train.max_steps=8"):
        resume_plan.choose(resume_plan.plan_for("auto", False, str(tmp_path)), str(tmp_path),
                           lambda path, meta: [], 8, print)
    with pytest.raises(resume_plan.ckpt.CheckpointError, match="cannot resume from"):
        resume_plan.choose(resume_plan.plan_for(older, False, str(tmp_path)), str(tmp_path),
                           lambda path, meta: ["the data differs"], 10, print)


def test_train_states_are_stateful_and_round_trip():
    class Sampler:
        loaded = None

        def state_dict(self, consumed):
            return {"consumed_batches": consumed}

        def load_state_dict(self, state):
            self.loaded = state

    state, sampler = TrainState(step=3, tokens_seen=96, skipped_steps=1), Sampler()
    position = DataPosition(sampler, state)
    for obj in (state, position, RandomState()):
        assert isinstance(obj, Stateful)
    assert state.state_dict() == {"step": 3, "tokens_seen": 96, "skipped_steps": 1}  # meta.json's keys
    assert position.state_dict() == {"consumed_batches": 3}
    again = TrainState()
    again.load_state_dict(state.state_dict())
    assert again == state
    position.load_state_dict({"consumed_batches": 3})
    assert sampler.loaded == {"consumed_batches": 3}


def test_nothing_outside_the_config_package_writes_into_the_config():
    writes = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        if "config" in path.relative_to(REPO / "trainer").parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                root = target
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and root.id == "cfg":
                    writes.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not writes, writes
