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


def test_the_on_the_fly_reference_is_refused_where_it_cannot_be_the_starting_model():
    pairs = ["data=preference", "data.path=p.jsonl", "objective.reference=on_the_fly"]
    assert _problems(["objective=dpo", *pairs]) == [] and _problems(["objective=ipo", "peft=lora", *pairs]) == []
    assert _problems(["objective=simpo", *pairs]) == [
        "objective.reference=on_the_fly: objective=simpo has no reference model; leave objective.reference=offline"]
    adapter = _problems(["objective=dpo", "peft=lora", "peft.adapter=/some/adapter", *pairs])
    assert len(adapter) == 1 and "objective.reference=on_the_fly with peft.adapter" in adapter[0]


def test_the_live_reference_scores_each_pair_as_if_alone():
    """LiveReference forwards one pair at a time: a pair's scores are the same bits whichever pairs share its
    micro-batch, and equal the policy's own when the policy is the reference (DPO's loss log 2 per pair)."""
    from trainer.objectives.reference import LiveReference

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    rows_seen = []  # this model's rows do not mix, so the forwards' own sizes show one pair per forward

    def forward(batch):
        rows_seen.append(batch["input_ids"].shape[0])
        return model(batch["input_ids"])

    ids, labels = torch.randint(0, 11, (6, 5)), torch.randint(0, 11, (6, 5))
    labels[:, :2] = IGNORE
    live = LiveReference(forward)
    together = live.logps({"input_ids": ids, "labels": labels})
    assert rows_seen == [2, 2, 2]
    alone = torch.cat([live.logps({"input_ids": ids[i:i + 2], "labels": labels[i:i + 2]}) for i in (0, 2, 4)])
    swapped = live.logps({"input_ids": ids[[4, 5, 0, 1]], "labels": labels[[4, 5, 0, 1]]})
    assert torch.equal(together, alone) and torch.equal(swapped, together[[4, 5, 0, 1]])
    objective = Preference(compose_config(["objective=dpo"]).objective)
    objective.use_reference(live)
    batch = objective.prepare({"input_ids": ids, "labels": labels})
    assert torch.equal(batch["reference_logps"], together)
    loss = objective.loss_sum(forward(batch), batch)
    assert float(loss) == pytest.approx(3 * 0.6931471805599453, rel=1e-7)


def test_a_mixture_of_preference_sources_trains_a_preference_objective_only():
    pairs = "data.sources=[{name: a, kind: preference, path: a.json}, {name: b, kind: preference, path: b.json}]"
    text = "data.sources=[{name: a, kind: text, path: a.txt}, {name: b, kind: sft, path: b.json}]"
    assert _problems(["objective=dpo", "data=mixture", pairs]) == []
    assert "the mixture's preference sources hold pairs for a preference objective: set objective=dpo" in \
        _problems(["data=mixture", pairs])[0]
    assert "objective=orpo trains on preference pairs" in _problems(["objective=orpo", "data=mixture", text])[0]


def test_a_mixture_reports_each_task_s_pair_loss_rewards_and_accuracy():
    """Each pair's figures go to its task (the batch's task column), summed over data-parallel ranks by dp_sum."""
    objective = Preference(compose_config(["objective=simpo"]).objective)
    objective.track_tasks(2, torch.device("cpu"))
    logits, labels = torch.randn(6, 5, 11), torch.randint(0, 11, (6, 5))
    total = objective.loss_sum(logits, {"labels": labels, "task": torch.tensor([1, 0, 1])})
    words, count = objective.task_metrics(lambda t: 2 * t)  # two ranks that saw the same pairs
    alone = [Preference(compose_config(["objective=simpo"]).objective) for _ in range(2)]
    first = alone[0].loss_sum(logits[2:4], {"labels": labels[2:4]})
    rest = alone[1].loss_sum(logits[[0, 1, 4, 5]], {"labels": labels[[0, 1, 4, 5]]})
    assert words["pairs"] == 2 and count["pairs"] == 4
    assert words["loss"] == pytest.approx(float(first)) and count["loss"] == pytest.approx(float(rest) / 2)
    assert {k: count[k] for k in alone[1].metrics(lambda t: t)} == pytest.approx(alone[1].metrics(lambda t: t))
    assert float(total) == pytest.approx(float(first + rest))
    objective.reset()
    assert objective.task_metrics(lambda t: t)[0] == {"loss": None, "pairs": 0, "chosen_reward": None,
                                                      "rejected_reward": None, "margin": None, "accuracy": None}
