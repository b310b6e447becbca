"""Fine-tuning real pretrained weights, export round-trips, and the entry point's command-line behaviour."""
from __future__ import annotations

import subprocess
import sys

import torch

from tests.conftest import compose_config
from tests.integration.conftest import REPO, SMALL, launch, ok, read_jsonl


def _train_in_process(overrides, run_dir):
    """prepare -> build -> fit -> export, as trainer/main.py does, keeping the trained model for inspection."""
    from trainer import build as B
    from trainer.loop import export_final, fit

    cfg = compose_config(overrides)
    run = B.build(B.prepare(cfg, str(run_dir)))
    try:
        fit(run)
        export_final(run)
        model = run.strategy.unwrapped()
        return run, model
    finally:
        run.logger.close()


def test_finetune_stories260k_on_shakespeare_lowers_val_loss_and_exports(shared_data, tmp_path):
    from transformers import AutoModelForCausalLM

    overrides = ["model=hf", f"model.name_or_path={shared_data / 'models' / 'stories260K-hf'}", "data=text",
                 f"data.path={shared_data / 'datasets' / 'tinyshakespeare.txt'}", "data.seq_len=128",
                 "strategy=single", "train.max_steps=30", "train.global_batch_size=8", "train.micro_batch_size=8",
                 "train.log_every=10", "eval.at_start=true", "eval.every=0", "eval.max_sequences=64",
                 "optim.lr=2e-3", "scheduler.warmup_steps=3", "logging.progress=false"]
    run, model = _train_in_process(overrides, tmp_path)
    evals = read_jsonl(tmp_path / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 30]
    assert evals[1]["val_loss"] < evals[0]["val_loss"] - 0.2, evals  # Shakespeare is new to a stories model

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([run.tokenizer("ROMEO: But soft, what light")["input_ids"]])
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_sft_on_alpaca_trains_only_on_responses(shared_data, tmp_path):
    overrides = ["experiment=alpaca_sft", f"model.name_or_path={shared_data / 'models' / 'stories260K-hf'}",
                 f"data.path={shared_data / 'datasets' / 'alpaca_en_demo.json'}", "strategy=single",
                 "train.max_steps=2", "train.global_batch_size=4", "train.micro_batch_size=4",
                 "train.log_every=1", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false",
                 "logging.progress=false"]
    run, _ = _train_in_process(overrides, tmp_path)
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    batch = run.data.train.get(run.sampler.global_batch(0))
    targets = int((batch["labels"] != -100).sum())
    # A step counts the response tokens only: every row has masked prompt (and padding) positions.
    assert recs[0]["tokens"] == targets
    assert all((row == -100).any() and (row != -100).any() for row in batch["labels"])


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
