"""Fine-tuning pretrained weights (a generated tiny Llama; stories260K where ../shared is present), SFT on
alpaca-style and chat records, export round-trips, and the entry point's command-line behaviour."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import compose_config
from tests.integration.conftest import REPO, SMALL, launch, ok, read_jsonl, rel_err, val_loss


def _train_in_process(overrides, run_dir):
    """prepare -> build -> fit -> export, as trainer/main.py does, keeping the trained model for inspection."""
    from trainer.run import build as B
    from trainer.run.loop import export_final, fit

    cfg = compose_config(overrides)
    run = B.build(B.prepare(cfg, str(run_dir)))
    try:
        fit(run)
        export_final(run)
        model = run.strategy.unwrapped()
        return run, model
    finally:
        run.logger.close()


# Validation loss before -> after 30 steps must fall by at least this much. [real]: stories260K meets Shakespeare
# (new to a stories model); [generated]: random weights (~ln 512 = 6.24 at the start) learn a play of random words.
FINETUNE_DROP = {"real": 0.2, "generated": 2.0}


def test_finetune_pretrained_on_text_lowers_val_loss_and_exports(data_source, tmp_path):
    from transformers import AutoModelForCausalLM

    overrides = ["model=hf", f"model.name_or_path={data_source.model}", "data=text", f"data.path={data_source.text}",
                 "data.seq_len=128", "strategy=single", "train.max_steps=30", "train.global_batch_size=8",
                 "train.micro_batch_size=8", "train.log_every=10", "eval.at_start=true", "eval.every=0",
                 "eval.max_sequences=64", "optim.lr=2e-3", "scheduler.warmup_steps=3", "logging.progress=false"]
    run, model = _train_in_process(overrides, tmp_path)
    evals = read_jsonl(tmp_path / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 30]
    drop = evals[0]["val_loss"] - evals[1]["val_loss"]
    print(f"finetune ({data_source.name}): val loss {evals[0]['val_loss']:.4f} -> {evals[1]['val_loss']:.4f}")
    assert drop > FINETUNE_DROP[data_source.name], evals
    # Step 0 evaluated the folder's weights: the model was loaded, not initialized.
    pretrained = AutoModelForCausalLM.from_pretrained(data_source.model, dtype="float32").eval()
    expected = val_loss(pretrained, tmp_path / "val", overrides)
    assert rel_err(evals[0]["val_loss"], expected) < 1e-6, (evals[0]["val_loss"], expected)

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([run.tokenizer("ROMEO: But soft, what light")["input_ids"]])
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def _sft_cases():
    # (id, data source, records): alpaca-style on both sources, chat records on the generated one.
    return [pytest.param("generated", "alpaca", id="generated-alpaca"),
            pytest.param("generated", "chat", id="generated-chat"),
            pytest.param("real", "alpaca", id="real-alpaca")]


@pytest.mark.parametrize("source,records", _sft_cases())
def test_sft_trains_only_on_responses(request, tmp_path, source, records):
    """data=sft (experiment=alpaca_sft with the records swapped): a step counts the response tokens only, every
    row has masked prompt positions and trained response positions."""
    from tests.conftest import _real_source, require_shared_data

    data = request.getfixturevalue("generated_data") if source == "generated" else _real_source(require_shared_data())
    path = getattr(data, records)
    overrides = ["experiment=alpaca_sft", f"model.name_or_path={data.model}", f"data.path={path}",
                 "strategy=single", "train.max_steps=2", "train.global_batch_size=4", "train.micro_batch_size=4",
                 "train.log_every=1", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false",
                 "logging.progress=false"]
    run, _ = _train_in_process(overrides, tmp_path)
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    batch = run.data.train.get(run.sampler.global_batch(0))
    targets = int((batch["labels"] != -100).sum())
    # A step counts the response tokens only: every row has masked prompt (and padding) positions.
    assert recs[0]["tokens"] == targets
    assert all((row == -100).any() and (row != -100).any() for row in batch["labels"])
    # The labelled positions are exactly the response texts: their tokens decode to text found in the records.
    row = batch["labels"][0]
    response = run.tokenizer.decode(row[row != -100].tolist(), skip_special_tokens=True).strip()
    raw = path.read_text()
    assert response and response.split()[0] in raw, response


def test_tensorboard_and_config_written(tmp_path):
    ok(launch("python", SMALL + ["strategy=single", "train.max_steps=2", "eval.every=0", "logging.tensorboard=true",
                                 "export.hf_at_end=false"], tmp_path))
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert "max_steps: 2" in (tmp_path / "config.yaml").read_text()


def test_cfg_job_prints_resolved_config():
    proc = subprocess.run([sys.executable, str(REPO / "trainer" / "main.py"), "--cfg", "job", "model=gpt2_10m",
                           "train.max_steps=7"], cwd=REPO, capture_output=True, text=True, timeout=120)
    ok(proc)
    assert "kind: gpt2" in proc.stdout and "max_steps: 7" in proc.stdout and "global_batch_size: 16" in proc.stdout


def test_deepspeed_style_local_rank_argument_is_accepted(tmp_path):
    for flag in (["--local_rank=0"], ["--local-rank=0"], ["--local_rank", "0"]):
        proc = launch("python", flag + SMALL + ["strategy=single", "train.max_steps=1", "eval.every=0",
                                                "eval.at_end=false", "export.hf_at_end=false"], tmp_path / f"run{len(flag)}{flag[0][7]}")
        ok(proc)
