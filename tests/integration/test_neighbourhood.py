"""The neighbourhood of each strategy: every option that changes how a strategy holds its state, toggled once on
its strategy (issue 28). Each row runs twice through the real launcher, fp32, on the debug-size model:

- A, uninterrupted: 6 steps, evaluating and then saving at steps 2, 4 and 6 (every save follows an evaluation:
  mid-run, and at the end), then exporting hf/;
- B, resumed from A's step-4 checkpoint into a fresh run directory: steps 5 and 6 equal A's (loss and gradient
  norm, fp32) and so does its last validation loss, its own save after the step-6 evaluation, and an hf/ export
  giving A's logits.

An export must also be the trained model: its validation loss (recomputed on one process with
from_pretrained) is the one the trainer measured after the last step, where every worker holds the same weights.
The last test prints the table (row, resume, export, seconds; shown with -s or -rA) and writes it to
$TESSERA_NEIGHBOURHOOD_OUT when that is set.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import pytest

from tests.integration.conftest import EXPORT_IDS, FP32_TOL, SMALL, launch, metrics, read_jsonl, rel_err, val_loss

STEPS, EVERY, SAVED = 6, 2, 4  # SAVED: the checkpoint B resumes from
# Evaluate and save every 2 steps: each save follows an evaluation (where FSDP without re-sharding lost its
# checkpoint), B resumes from one of them, and the last one ends the run.
COMMON = SMALL + [f"train.max_steps={STEPS}", "train.log_every=1", "train.global_batch_size=8",
                  "train.micro_batch_size=2", f"eval.every={EVERY}", "eval.max_sequences=8", "eval.at_end=true",
                  f"checkpoint.every={EVERY}", "checkpoint.keep_last=0", "checkpoint.at_end=true",
                  "export.hf_at_end=true"]
# An export equals the trained model: hf/ loaded with from_pretrained gives the trainer's last validation loss
# (check_export's bar); two exports of the same weights give the same logits.
EXPORT_TOL = 1e-5
LOGIT_TOL = 1e-6


@dataclass
class Row:
    name: str
    launcher: str
    nproc: int
    overrides: List[str]
    needs: Optional[str] = None  # "compile": only where inductor can run here; "hf": a pretrained folder
    timeout: float = 300


ROWS = [  # the heavy rows first, so that they do not run last and alone
    Row("hsdp 2x2 reshard_after_forward=false", "torchrun", 4,
        ["strategy=hsdp", "strategy.dp_replicate=2", "strategy.dp_shard=2", "strategy.reshard_after_forward=false",
         "train.micro_batch_size=1"]),
    Row("fsdp compile=true", "torchrun", 2, ["strategy=fsdp", "train.compile=true"], needs="compile", timeout=600),
    # three options of fsdp in one row: unsharded parameters kept after forward, recomputed blocks, a background save
    # (each changes what is held when a save follows an evaluation; a failure names the row, the log the option)
    Row("fsdp reshard_after_forward=false activation_checkpointing=full async_save=true", "torchrun", 2,
        ["strategy=fsdp", "strategy.reshard_after_forward=false", "train.activation_checkpointing=full",
         "checkpoint.async_save=true"]),
    Row("fsdp cpu_offload=true", "torchrun", 2, ["strategy=fsdp", "strategy.cpu_offload=true"]),
    Row("fsdp peft=lora", "torchrun", 2, ["strategy=fsdp", "peft=lora", "peft.r=4", "peft.alpha=8", "optim.lr=1e-2"],
        needs="hf"),
    Row("tp sequence_parallel=true", "torchrun", 2, ["strategy=tp", "strategy.sequence_parallel=true"]),
    # compressed from step 3: the checkpoint of step 4 holds PowerSGD's error feedback
    Row("ddp comm_hook=powersgd", "torchrun", 2,
        ["strategy=ddp", "strategy.comm_hook=powersgd", "strategy.powersgd_rank=2",
         "strategy.powersgd_warmup_steps=2"]),
    # rounds of 3 steps: B resumes from inside a round (each worker's own weights, DiLoCo's anchor and outer
    # momentum in the checkpoint); the run ends synchronised, so the export is every worker's model
    Row("ddp sync=local_sgd every=3", "torchrun", 2, ["strategy=ddp", "sync=local_sgd", "sync.every=3"]),
    Row("ddp sync=diloco every=3", "torchrun", 2, ["strategy=ddp", "sync=diloco", "sync.every=3"]),
    # ZeRO through torchrun, a launcher it supports (the deepspeed launcher starts a second launcher process, seconds
    # more per launch; test_deepspeed.py and test_launchers.py run it)
    Row("zero2 offload_optimizer=cpu", "torchrun", 2, ["strategy=zero2", "strategy.offload_optimizer=cpu"]),
    Row("zero3_offload", "torchrun", 2, ["strategy=zero3_offload"]),
]
IDS = [r.name.replace(" ", "-") for r in ROWS]
FOLDERS = [re.sub(r"[^A-Za-z0-9_-]+", "-", r.name) for r in ROWS]  # run directories: no "=" in Hydra's overrides


@dataclass
class Outcome:
    row: Row
    first: Optional[Path] = None
    resumed: Optional[Path] = None
    procs: dict = field(default_factory=dict)  # "A" / "B" -> CompletedProcess
    error: Optional[str] = None  # a launch that failed (or timed out): its exit and output's tail
    skipped: Optional[str] = None


def _overrides(row: Row, hf_model: Optional[Path], options: bool = True) -> List[str]:
    """The row's launch overrides; without its options, what the one-process validation loss needs (model, data)."""
    out = list(COMMON)
    if row.needs == "hf":  # the generated tiny Llama (embedded tokenizer) on the embedded data
        out = [o for o in out if not o.startswith("model.")] + ["model=hf", f"model.name_or_path={hf_model}"]
    return out + (row.overrides if options else [])


def _failed(name, proc) -> str:
    return (f"{name}: exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}")


def _run_row(row: Row, root: Path, hf_model: Optional[Path]) -> Outcome:
    """A, then B from A's step-SAVED checkpoint; never raises (a failing row must not stop the others)."""
    out = Outcome(row, root / "A", root / "B")
    if row.needs == "compile":
        from trainer.config.compat import compile_problems

        problems = compile_problems("cpu")
        if problems:
            out.skipped = problems[0]
            return out
    overrides = _overrides(row, hf_model)
    try:
        out.procs["A"] = proc = launch(row.launcher, overrides, out.first, nproc=row.nproc, timeout=row.timeout)
        if proc.returncode != 0:
            out.error = _failed("A (uninterrupted)", proc)
            return out
        resume = f"checkpoint.resume={out.first / 'checkpoints' / f'step_{SAVED}'}"
        out.procs["B"] = proc = launch(row.launcher, overrides + [resume], out.resumed, nproc=row.nproc,
                                       timeout=row.timeout)
        if proc.returncode != 0:
            out.error = _failed("B (resumed)", proc)
    except AssertionError as exc:  # run_process_group's timeout (a hang): every process of the launch was killed
        out.error = str(exc)
    return out


@pytest.fixture(scope="module")
def hf_model(generated_data):
    return generated_data.model


@pytest.fixture(scope="module")
def outcomes(hf_model, tmp_path_factory):
    """Every row's two launches, two rows at a time (the launches are mostly start-up): name -> Outcome."""
    root = tmp_path_factory.mktemp("neighbourhood")
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda ir: _run_row(ir[1], root / FOLDERS[ir[0]], hf_model), enumerate(ROWS)))
    return {o.row.name: o for o in done}


TABLE: dict = {}  # name -> (resume, export), for the table printed by the last test


def _logits(folder):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model, model(torch.tensor(EXPORT_IDS)).logits


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_saves_after_evaluation_resumes_exactly_and_exports(outcomes, hf_model, tmp_path, row):
    from tests.integration import catalogue

    got = outcomes[row.name]
    if got.skipped:
        TABLE[row.name] = (f"not run: {got.skipped}", "")
        pytest.skip(got.skipped)
    if got.error:
        TABLE[row.name] = ("FAILED: " + got.error.splitlines()[0] + " " + catalogue.message_of(got.error), "")
    assert not got.error, got.error
    first, resumed = got.first, got.resumed
    # A: evaluated, then saved, every 2 steps, and exported; B saved after its last evaluation and exported
    for step in range(EVERY, STEPS + 1, EVERY):
        assert (first / "checkpoints" / f"step_{step}" / "COMPLETE.json").is_file(), step
    assert [e["step"] for e in read_jsonl(first / "eval.jsonl")] == list(range(EVERY, STEPS + 1, EVERY))
    assert (resumed / "checkpoints" / f"step_{STEPS}" / "COMPLETE.json").is_file()
    for run in (first, resumed):
        assert (run / "hf" / "config.json").is_file(), run
    out_b = got.procs["B"].stdout + got.procs["B"].stderr
    assert "resumed from" in out_b and f"at step {SAVED}" in out_b, out_b[-3000:]

    # B continues A: the same losses and gradient norms, and the same validation loss at the end
    ref = {r["step"]: r for r in metrics(first)}
    recs = metrics(resumed)
    assert [r["step"] for r in recs] == list(range(SAVED + 1, STEPS + 1)), [r["step"] for r in recs]
    exact = all((r["loss"], r["grad_norm"]) == (ref[r["step"]]["loss"], ref[r["step"]]["grad_norm"]) for r in recs)
    err = max(max(rel_err(r["loss"], ref[r["step"]]["loss"]), rel_err(r["grad_norm"], ref[r["step"]]["grad_norm"]))
              for r in recs)
    val_a, val_b = (read_jsonl(run / "eval.jsonl")[-1] for run in (first, resumed))
    assert val_a["step"] == val_b["step"] == STEPS
    val_err = rel_err(val_b["val_loss"], val_a["val_loss"])
    resume = ("equal (bit-identical)" if exact and val_err == 0
              else f"max rel diff {max(err, val_err):.1e}")
    TABLE[row.name] = (resume, "")
    print(f"{row.name}: steps {SAVED + 1}-{STEPS} after resume: {resume} (val loss {val_err:.1e})")
    assert err <= FP32_TOL and val_err <= FP32_TOL, (err, val_err)

    # the exports: B's hf/ gives A's logits, and A's is the model the trainer evaluated last
    import torch

    model_a, logits_a = _logits(first / "hf")
    _, logits_b = _logits(resumed / "hf")
    diff = (logits_a - logits_b).abs().max().item()
    export = f"hf/ logits A vs B {diff:.1e}"
    loss = val_loss(model_a, tmp_path / "val", _overrides(row, hf_model, options=False))
    export += f", val loss vs trainer's {rel_err(loss, val_a['val_loss']):.1e}"
    TABLE[row.name] = (resume, export)
    print(f"{row.name}: export {export}")
    assert torch.isfinite(logits_a).all()
    assert diff <= LOGIT_TOL, diff
    assert rel_err(loss, val_a["val_loss"]) < EXPORT_TOL, (loss, val_a["val_loss"])


def test_zz_the_table(outcomes):
    """The table for the issue's closing note (after every row's test; with xdist this file runs on one worker)."""
    lines = [f"| option (strategy, ranks) | steps {SAVED + 1}-{STEPS} resumed vs uninterrupted (fp32) | export | "
             f"seconds (A + B) |", "|---|---|---|---|"]
    for row in ROWS:
        resume, export = TABLE.get(row.name, ("(not checked)", ""))
        seconds = " + ".join(f"{p.seconds:.0f}" for p in outcomes[row.name].procs.values() if hasattr(p, "seconds"))
        lines.append(f"| {row.name} ({row.nproc} ranks) | {resume.replace('|', '/')} | {export} | {seconds} |")
    text = "\n".join(lines)
    print("\n" + text)
    out = os.environ.get("TESSERA_NEIGHBOURHOOD_OUT")
    if out:
        Path(out).write_text(text + "\n")
