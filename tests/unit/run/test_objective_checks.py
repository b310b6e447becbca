"""The objective's checks before any process group (trainer/objectives/objective.py objective_problems): objective
and data agree, and the layouts a preference loss cannot serve are refused with one message each; the preference
objective's metrics average over the pairs that have targets (an evaluation's fillers count nothing)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import compose_config
from trainer.data.datasets import IGNORE
from trainer.objectives.objective import Preference, objective_problems

DIMS = SimpleNamespace(pp=1, cp=1)


def _problems(overrides, dims=DIMS):
    return objective_problems(compose_config(overrides), dims)


def test_objective_and_data_agree():
    assert _problems([]) == [] and _problems(["objective=dpo", "data=preference", "data.path=p.jsonl"]) == []
    assert "objective=dpo trains on preference pairs: set data=preference" in _problems(["objective=dpo"])[0]
    assert "data.kind=preference holds pairs for a preference objective: set objective=dpo" in \
        _problems(["data=preference", "data.path=p.jsonl"])[0]


@pytest.mark.parametrize("overrides,dims,what", [
    (["strategy=pp"], SimpleNamespace(pp=2, cp=1), "strategy.pp"),
    (["strategy=fsdp", "strategy.cp=2"], SimpleNamespace(pp=1, cp=2), "strategy.cp"),
    (["strategy=hsdp", "strategy.fault_tolerance=torchft"], DIMS, "strategy.fault_tolerance=torchft"),
    (["strategy=ddp", "sync=local_sgd"], DIMS, "sync=local_sgd"),
])
def test_layouts_a_pair_loss_cannot_serve_are_refused(overrides, dims, what):
    problems = _problems(["objective=simpo", "data=preference", "data.path=p.jsonl", *overrides], dims)
    assert problems == [f"objective=simpo is not available with {what} (a pair's loss needs both responses' whole "
                        f"log-probabilities in one place); train it without"]


def test_metrics_count_only_pairs_with_targets():
    """Two pairs, the second an evaluation filler (no targets): its loss and rewards count nothing."""
    objective = Preference(compose_config(["objective=simpo"]).objective)
    logits = torch.randn(4, 5, 11)
    labels = torch.randint(0, 11, (4, 5))
    labels[2:] = IGNORE
    loss = objective.loss_sum(logits, {"labels": labels})
    one = Preference(compose_config(["objective=simpo"]).objective)
    assert float(loss) == pytest.approx(float(one.loss_sum(logits[:2], {"labels": labels[:2]})))
    assert objective.metrics(lambda t: t) == one.metrics(lambda t: t)
    assert set(objective.metrics(lambda t: t)) == {"chosen_reward", "rejected_reward", "margin", "accuracy"}
