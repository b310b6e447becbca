"""One batch of DPO against TRL's DPOTrainer (the peer), end to end on the same model and pairs: Tessera's pairs
(data=preference: rendered with the chat template, response-only labels), the reference's log-probabilities and the
objective's loss and rewards, against what DPOTrainer.compute_loss gives for the same conversational records with
the same template, policy and reference model. The chat template ends each assistant turn at EOS, so TRL's
completion (everything after the prompt) and Tessera's response mask cover the same tokens."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import trl  # a test dependency (pyproject's dev extra)
from datasets import Dataset

from models import registry
from trainer.config.schema import DataConfig, ModelConfig, ObjectiveConfig, TesseraConfig
from trainer.data.datasets import build_data
from trainer.objectives.objective import Preference
from trainer.objectives.preference import sequence_logps

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
RECORDS = [{"prompt": [{"role": "user", "content": "Name a colour."}],
            "chosen": [{"role": "assistant", "content": "Blue, like the sky."}],
            "rejected": [{"role": "assistant", "content": "Sky the like blue."}]},
           {"prompt": [{"role": "user", "content": "Count to three."}],
            "chosen": [{"role": "assistant", "content": "One, two, three."}],
            "rejected": [{"role": "assistant", "content": "Three one two."}]}]
BETA = 0.1


def _models():
    cfg = ModelConfig(kind="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                      max_position_embeddings=256)
    tokenizer = registry.load_tokenizer(cfg)
    reference = registry.build(cfg, registry.describe(cfg, tokenizer), seed=0).float()
    policy = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a policy some way from its reference, so the loss is not log 2
        for p in policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return tokenizer, reference.eval(), policy.eval()


def _tessera(tmp_path, tokenizer, reference, policy):
    path = Path(tmp_path) / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    cfg = TesseraConfig()
    cfg.data = DataConfig(kind="preference", path=str(path), cache_dir=str(Path(tmp_path) / "cache"),
                          val_fraction=0.0, seq_len=96, chat_template=TEMPLATE)
    data = build_data(cfg, tokenizer, reference.config.vocab_size, log=lambda m: None)
    batch = data.train.get([0, 1])  # rows: chosen 0, rejected 0, chosen 1, rejected 1
    with torch.no_grad():
        batch["reference_logps"] = sequence_logps(reference(input_ids=batch["input_ids"]).logits, batch["labels"])[0]
        objective = Preference(ObjectiveConfig(name="dpo", beta=BETA))
        loss = objective.loss_sum(policy(input_ids=batch["input_ids"]).logits, batch) / 2
    return float(loss), objective.metrics(lambda t: t), batch["reference_logps"]


def _trl(tmp_path, tokenizer, reference, policy, reference_logps):
    """TRL's loss and logged rewards for the records in order (its evaluation loader), its policy forward on its
    own tokenization; the reference: TRL's own forward, and Tessera's scores given as TRL's precomputed ones."""
    tokenizer.chat_template = TEMPLATE
    args = trl.DPOConfig(output_dir=str(Path(tmp_path) / "trl"), beta=BETA, per_device_eval_batch_size=2,
                         report_to=[], use_cpu=True, max_length=None)
    dataset = Dataset.from_list(RECORDS)
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=dataset,
                             eval_dataset=dataset, processing_class=tokenizer)
    inputs = next(iter(trainer.get_eval_dataloader()))  # rows: chosen 0, chosen 1, rejected 0, rejected 1
    with torch.no_grad():
        own_reference = torch.cat(trainer.compute_ref_log_probs(reference, inputs))
        trainer.precompute_ref_logps = True
        inputs = dict(inputs, ref_chosen_logps=reference_logps[0::2], ref_rejected_logps=reference_logps[1::2])
        loss = trainer.compute_loss(policy, inputs)
    logged = {k: sum(v) / len(v) for k, v in trainer._metrics["eval"].items()}
    return float(loss), logged, own_reference


def test_one_batch_of_dpo_equals_trls(tmp_path):
    tokenizer, reference, policy = _models()
    loss, ours, reference_logps = _tessera(tmp_path, tokenizer, reference, policy)
    trl_loss, theirs, trl_reference = _trl(tmp_path, copy.deepcopy(tokenizer), reference, policy, reference_logps)
    print(f"tessera loss {loss:.8f} rewards {ours}; trl loss {trl_loss:.8f} rewards {theirs}")
    assert abs(loss - 0.6931) > 1e-3  # the policy is not its reference
    assert loss == pytest.approx(trl_loss, rel=1e-6)
    assert ours["chosen_reward"] == pytest.approx(theirs["rewards/chosen"], rel=1e-5)
    assert ours["rejected_reward"] == pytest.approx(theirs["rewards/rejected"], rel=1e-5)
    assert ours["margin"] == pytest.approx(theirs["rewards/margins"], rel=1e-5)
    assert ours["accuracy"] == pytest.approx(theirs["rewards/accuracies"])
    # TRL's own reference forward (padded batch, its fused head) gives the same scores within fp32 reorderings
    mine = torch.stack([reference_logps[0::2], reference_logps[1::2]]).reshape(-1)
    assert torch.allclose(trl_reference.float(), mine.float(), rtol=1e-5), (trl_reference, mine)
