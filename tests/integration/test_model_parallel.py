"""Tensor and pipeline parallelism and their hybrids (strategy=tp / pp / fsdp_tp / pp_fsdp / 3d) through torchrun
on CPU (gloo): parity with one process under gradient accumulation (every pipeline schedule), evaluation through
the pipeline, DCP checkpoints with exact resume and resume under other degrees, HF export, and a pretrained
model split by its config's tensor-parallel plan."""
from __future__ import annotations

import json

import pytest
import torch

from tests.integration.conftest import (
    EXPORT_IDS, FP32_TOL, SMALL, check_export, check_generation_config, check_parity, check_pretrained_loaded,
    curve_errors, launch, metrics, ok, pretrained_overrides, read_jsonl, rel_err)

# SMALL with 4 decoder blocks, so that the looped / V-shaped schedules (2 stages per rank x 2 ranks) get a
# block per stage. Global batch 8, 10 steps, fp32; nothing written that the test does not read.
MODEL = [o for o in SMALL if not o.startswith("model.num_layers=")] + ["model.num_layers=4"]
TEN = MODEL + ["train.max_steps=10", "train.log_every=1", "train.global_batch_size=8", "eval.every=0",
               "eval.at_end=false", "export.hf_at_end=false", "checkpoint.at_end=false"]
# The shared runs (and their resumptions): checkpoints and evaluation at steps 5 and 10.
SAVE = ["checkpoint.every=5", "checkpoint.keep_last=0", "eval.every=5"]
# What the shared runs add at the end: the final checkpoint and the HF export.
AT_END = ["checkpoint.at_end=true", "eval.at_end=true", "export.hf_at_end=true"]

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]
# Each launch costs ~10-30 s of start-up on 2 cores: these schedules train 3 steps (compared with the first 3 of
# the 10-step reference: with 1 warmup step the lr of the first two updates does not depend on train.max_steps).
SHORT_SCHEDULES = {"looped_bfs", "interleaved_zb", "dualpipev"}
# Extra settings per schedule: gpipe also cuts the model by strategy.pp_split_points (stage 0: block 0 after the
# embedding; stage 1: blocks 1-3 and the head) instead of the balanced 2 + 2.
# fp32 bytes of one decoder block of MODEL (hidden 64, 4 heads, 2 KV heads, intermediate 128, two RMSNorms).
BLOCK_BYTES = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64)
SCHEDULE_EXTRA = {"gpipe": ["strategy.pp_split_points=[1]", "logging.memory_report=true"]}
# The schedule of the shared pp run: V-shaped, so rank 0 holds the first and the last stage (0 and 3) and rank 1
# the middle ones; evaluation, checkpoints and the export all go through two stages per rank.
PP_SHARED = "zbv"


def _launch_checked(run_dir, overrides, nproc, strategy, dp, timeout=300):
    proc = launch("torchrun", overrides, run_dir, nproc=nproc, timeout=timeout)
    ok(proc)
    out = proc.stdout + proc.stderr
    assert f"strategy {strategy} world {nproc} (dp {dp})" in out, out[-3000:]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, micro 2 (accumulation 4), evaluated at steps 5 and 10: the curves every run must reproduce."""
    run_dir = tmp_path_factory.mktemp("single")
    ok(launch("python", TEN + ["strategy=single", "train.micro_batch_size=2", "eval.every=5"], run_dir))
    return run_dir


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """tp at world size 2, micro 2 (accumulation 4): checkpoints at steps 5 and 10, evaluation at 5 and 10, HF
    export at the end. Serves the parity, checkpoint and export tests."""
    run_dir = tmp_path_factory.mktemp("tp2")
    _launch_checked(run_dir, TEN + SAVE + AT_END + ["strategy=tp", "train.micro_batch_size=2",
                                                    "logging.memory_report=true"], 2, "tp", 1)
    for step in (5, 10):
        assert (run_dir / "checkpoints" / f"step_{step}" / "COMPLETE.json").is_file()
    return run_dir


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    """pp at world size 2 with the zbv schedule, micro 2 (4 micro-batches per step, 4 stages): like tp_run."""
    run_dir = tmp_path_factory.mktemp("pp2")
    _launch_checked(run_dir, TEN + SAVE + AT_END + ["strategy=pp", f"strategy.pp_schedule={PP_SHARED}",
                                                    "train.micro_batch_size=2"], 2, "pp", 1)
    for step in (5, 10):
        assert (run_dir / "checkpoints" / f"step_{step}" / "COMPLETE.json").is_file()
    return run_dir






# ---- parity with one process ---------------------------------------------------------------------------------
def test_tp_ws2_with_accumulation_matches_single_process(reference, tp_run):
    """Also shows that saving, evaluating and exporting do not disturb training."""
    check_parity("tp-ws2 (accumulation 4)", metrics(tp_run), metrics(reference))


def test_sequence_parallelism_keeps_the_norms_inside_attention_whole(tmp_path):
    """strategy.sequence_parallel=true splits the blocks' own norms (on the residual stream) over the sequence; a
    norm inside attention sees the gathered sequence (DeepSeek's latent-attention norms, OLMo 2's q/k norms) and
    stays whole. Before, every norm in a block was split, and those inside attention had their gradient summed
    over the ranks as if each held another part of the sequence: 1.3e-4 off in the gradient norm on this model."""
    from transformers import AutoModelForCausalLM

    from models.tokenizer import embedded_tokenizer
    from tests.archs import LAYERS, make_config
    from tests.integration import arch_worker as W

    config = make_config("deepseek_v3")
    config.first_k_dense_replace = LAYERS  # dense blocks: sequence parallelism refuses experts
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "models" / "mla")
    embedded_tokenizer().save_pretrained(tmp_path / "models" / "mla")
    one = W.job_overrides("mla", "single", tmp_path / "models")
    ok(launch("python", one, tmp_path / "single"))
    sp = W.job_overrides("mla", "tp", tmp_path / "models") + ["strategy.sequence_parallel=true"]
    _launch_checked(tmp_path / "sp", sp, 2, "tp", 1)
    loss_err, norm_err = curve_errors(metrics(tmp_path / "sp"), metrics(tmp_path / "single"))
    assert loss_err < 1e-6 and norm_err < 1e-5, (loss_err, norm_err)


def test_tp_gradients_keep_their_parameters_layout(tp_run):
    """fp32: each rank's gradients take exactly the bytes of its parameter shards. Torch's embedding backward
    returns the vocabulary-split embedding's gradient whole (Replicate); the strategy keeps the local slice."""
    data = json.loads((tp_run / "memory.json").read_text())
    for r in data["ranks"]:
        step = r["points"]["optimizer_step"]
        assert step["grads"] == step["params"] > 0, (r["rank"], step["grads"], step["params"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp_ws2_schedule_matches_single_process(reference, request, tmp_path, schedule):
    """Every pipeline schedule, 4 micro-batches per step (gpipe / 1f1b: one stage per rank; interleaved_1f1b,
    looped_bfs, interleaved_zb: 2 looped stages per rank; zbv, dualpipev: 2 V-shaped stages per rank)."""
    steps = 3 if schedule in SHORT_SCHEDULES else 10
    extra = SCHEDULE_EXTRA.get(schedule, [])
    if schedule == PP_SHARED:
        run_dir = request.getfixturevalue("pp_run")
    else:
        run_dir = tmp_path
        _launch_checked(run_dir, TEN + ["strategy=pp", f"strategy.pp_schedule={schedule}",
                                              "train.micro_batch_size=2", f"train.max_steps={steps}"] + extra,
                              2, "pp", 1)
        if extra:  # the cut really moved: stage 1 holds two decoder blocks more than stage 0
            ranks = json.loads((run_dir / "memory.json").read_text())["ranks"]
            held = [r["points"]["optimizer_step"]["params"] for r in ranks]
            print(f"pp-{schedule} with {extra[0]}: parameter bytes per stage {held}")
            assert held[1] - held[0] == pytest.approx(2 * BLOCK_BYTES, rel=0.01), (held, BLOCK_BYTES)
    check_parity(f"pp-{schedule} ws2 (4 micro-batches{', ' + extra[0] if extra else ''})", metrics(run_dir),
                  metrics(reference), steps=steps)


HYBRIDS = [
    # (id, strategy, nproc, dp, micro, extra overrides)
    # (id, strategy, nproc, dp, micro, extra overrides, steps). fsdp_tp as docs/strategies-and-layouts.md shows it, with sequence
    # parallelism (activations outside attention/MLP split over the sequence).
    pytest.param(("fsdp_tp-ws4 (dp_shard 2 x tp 2, sequence parallel)", "fsdp_tp", 4, 2, 2,
                  ["strategy.tp=2", "strategy.sequence_parallel=true"], 10), id="fsdp_tp-sp-ws4"),
    pytest.param(("pp_fsdp-ws4 (pp 2 x dp_shard 2)", "pp_fsdp", 4, 2, 2, ["strategy.pp=2"], 10), id="pp_fsdp-ws4"),
    # The smallest world with every degree > 1 (8 processes on the CI's 2 cores): 3 steps, the command in docs/strategies-and-layouts.md.
    pytest.param(("3d-ws8 (pp 2 x dp_shard 2 x tp 2, interleaved_1f1b)", "3d", 8, 2, 1,
                  ["strategy.pp=2", "strategy.tp=2", "strategy.pp_schedule=interleaved_1f1b"], 3), id="3d-ws8"),
]


@pytest.mark.parametrize("case", HYBRIDS)
def test_hybrid_layouts_match_single_process(reference, tmp_path, case):
    """2-D and 3-D meshes with accumulation: 2 micro-batches per step at ws4, 4 at ws8 (micro 1)."""
    name, strategy, nproc, dp, micro, extra, steps = case
    _launch_checked(tmp_path, TEN + [f"strategy={strategy}", f"train.micro_batch_size={micro}",
                                     f"train.max_steps={steps}"] + extra, nproc, strategy, dp,
                    timeout=900 if nproc > 4 else 600)
    check_parity(name, metrics(tmp_path), metrics(reference), steps=steps)


@pytest.fixture(scope="module")
def reference_bf16(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single-bf16")
    ok(launch("python", TEN + ["strategy=single", "train.micro_batch_size=2", "precision=bf16"], run_dir))
    return run_dir


BF16_HYBRIDS = [
    # (id, overrides, dp): pp x tp without data parallelism computes under autocast (DTensors in a pipeline);
    # pp x FSDP casts through FSDP's mixed-precision policy.
    pytest.param(("3d-ws4 (pp 2 x tp 2, autocast)", ["strategy=3d", "strategy.dp_shard=1"], 1), id="pp_tp-ws4"),
    pytest.param(("pp_fsdp-ws4 (pp 2 x dp_shard 2, FSDP cast)", ["strategy=pp_fsdp", "strategy.pp=2"], 2),
                 id="pp_fsdp-ws4"),
]


@pytest.mark.parametrize("case", BF16_HYBRIDS)
def test_bf16_hybrids_compute_in_bf16(reference, reference_bf16, tmp_path, case):
    """precision=bf16 on a hybrid: the curve is single-process bf16's within a bf16 tolerance, and leaves the
    fp32 curve by more than fp32 rounding (before, pp and tp without FSDP silently computed in fp32)."""
    name, overrides, dp = case
    strategy = overrides[0].split("=")[1]
    _launch_checked(tmp_path, TEN + overrides + ["train.micro_batch_size=2", "precision=bf16"], 4, strategy, dp,
                    timeout=600)
    recs = metrics(tmp_path)
    loss_err, norm_err = curve_errors(recs, metrics(reference_bf16))
    from_fp32 = max(curve_errors(recs, metrics(reference)))
    print(f"{name} bf16 vs single bf16: loss {loss_err:.1e}, grad norm {norm_err:.1e}; vs fp32 {from_fp32:.1e}")
    # bf16 vs bf16 on another layout: the same roundings to 8 mantissa bits (~4e-3 relative each) happen in
    # another summation order (tensor-parallel partial sums, pipeline micro-batches), over 10 steps.
    assert loss_err < 2e-2 and norm_err < 2e-2, (loss_err, norm_err)
    assert from_fp32 > 1e-5, from_fp32


# ---- evaluation ----------------------------------------------------------------------------------------------
def test_pp_eval_matches_single_process(reference, pp_run):
    """Evaluation runs forward through the stages (hidden states sent between ranks both ways of the V): the
    validation loss at steps 5 and 10 is the one process's."""
    ref = read_jsonl(reference / "eval.jsonl")
    got = read_jsonl(pp_run / "eval.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [5, 10], (got, ref)
    errs = [rel_err(g["val_loss"], r["val_loss"]) for g, r in zip(got, ref)]
    print(f"pp-{PP_SHARED} ws2 eval: val loss {[round(g['val_loss'], 6) for g in got]} vs single's "
          f"{[round(r['val_loss'], 6) for r in ref]} (max relative error {max(errs):.2e})")
    assert max(errs) < FP32_TOL, (got, ref)


# ---- checkpoints ---------------------------------------------------------------------------------------------
def _resume(first, strategy_args, nproc, micro, run_dir, strategy, dp):
    out = _launch_checked(run_dir, TEN + SAVE + strategy_args + [
        f"train.micro_batch_size={micro}", f"checkpoint.resume={first / 'checkpoints' / 'step_5'}"],
        nproc, strategy, dp)
    assert "resumed from" in out and "at step 5" in out, out[-3000:]
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [6, 7, 8, 9, 10]
    return recs


def _check_bit_exact(name, first, recs, run_dir):
    before = {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics(first)}
    got = {r["step"]: (r["loss"], r["grad_norm"]) for r in recs}
    val_before = {r["step"]: r["val_loss"] for r in read_jsonl(first / "eval.jsonl")}
    val_got = {r["step"]: r["val_loss"] for r in read_jsonl(run_dir / "eval.jsonl")}
    print(f"{name} resume from step 5: {sum(got[s] == before[s] for s in got)}/{len(got)} steps bit-identical, "
          f"val loss at step 10 {val_got.get(10)} vs {val_before[10]}")
    assert all(got[s] == before[s] for s in got), (got, before)
    assert val_got == {10: val_before[10]}, (val_got, val_before)


def _check_close(name, first, recs, run_dir, tol=FP32_TOL):
    loss_err, norm_err = curve_errors(recs, metrics(first))
    val_got, val_before = (read_jsonl(d / "eval.jsonl")[-1] for d in (run_dir, first))
    assert val_got["step"] == val_before["step"] == 10, (val_got, val_before)
    val_err = rel_err(val_got["val_loss"], val_before["val_loss"])
    print(f"{name} resume from step 5: max relative loss error {loss_err:.2e}, grad-norm error {norm_err:.2e}, "
          f"val loss at step 10 {val_err:.2e}")
    assert loss_err < tol and norm_err < tol and val_err < tol, (loss_err, norm_err, val_err)


def test_pp_resume_is_bit_exact(pp_run, tmp_path):
    """Same layout: rank 1 (stages 1 and 2) holds no parameter that rank 0 holds, so its optimizer state and
    hyper-parameters must come back by its own parameters' names."""
    recs = _resume(pp_run, ["strategy=pp", f"strategy.pp_schedule={PP_SHARED}"], 2, 2, tmp_path, "pp", 1)
    _check_bit_exact(f"pp-{PP_SHARED} ws2", pp_run, recs, tmp_path)


def test_tp_resume_is_bit_exact(tp_run, tmp_path):
    recs = _resume(tp_run, ["strategy=tp"], 2, 2, tmp_path, "tp", 1)
    _check_bit_exact("tp ws2", tp_run, recs, tmp_path)


RESHARDS = [
    # (id, saved by, strategy overrides, nproc, micro, strategy, dp)
    ("tp2-to-pp2", "tp_run", ["strategy=pp", "strategy.pp_schedule=1f1b"], 2, 2, "pp", 1),
    ("tp2-to-fsdp2", "tp_run", ["strategy=fsdp"], 2, 2, "fsdp", 2),
    ("pp2-to-tp2", "pp_run", ["strategy=tp"], 2, 2, "tp", 1),
]


@pytest.mark.parametrize("case", RESHARDS, ids=[c[0] for c in RESHARDS])
def test_checkpoint_resumes_under_other_degrees(request, tmp_path, case):
    """DCP with the full model's parameter names: a checkpoint of tensor shards resumes as pipeline stages or as
    FSDP shards, and one of pipeline stages (saved by two stages per rank) as tensor shards."""
    name, saved_by, args, nproc, micro, strategy, dp = case
    first = request.getfixturevalue(saved_by)
    recs = _resume(first, args, nproc, micro, tmp_path, strategy, dp)
    _check_close(name, first, recs, tmp_path)


# ---- export --------------------------------------------------------------------------------------------------
IDS = torch.tensor(EXPORT_IDS)


@pytest.mark.parametrize("which", ["tp_run", "pp_run"])
def test_export_logits_equal_trained_model(request, tmp_path, which):
    """hf/ (written at the end of the run, one parameter gathered at a time from whichever tensor shard or
    pipeline stage holds it) and `python -m trainer.export` of the final DCP checkpoint give the same logits, and
    the exported model's validation loss is the one the trainer measured on its split model after the last
    step."""
    name = "tp-ws2" if which == "tp_run" else f"pp-{PP_SHARED}-ws2"
    at_end = check_export(request.getfixturevalue(which), tmp_path, TEN, name)
    assert at_end.config.num_hidden_layers == 4


def test_tp_and_pp_exports_agree(tp_run, pp_run):
    """The two layouts trained the same model: their exports give the same logits up to float rounding."""
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        lt = AutoModelForCausalLM.from_pretrained(tp_run / "hf").eval()(IDS).logits
        lp = AutoModelForCausalLM.from_pretrained(pp_run / "hf").eval()(IDS).logits
    print(f"tp-ws2 vs pp-{PP_SHARED}-ws2 exports: max logit difference {(lt - lp).abs().max().item():.2e}")
    torch.testing.assert_close(lt, lp, rtol=0, atol=1e-4)


# ---- pretrained weights --------------------------------------------------------------------------------------
def test_tp_pretrained_model_matches_single_process(generated_data, pretrained_reference, tmp_path):
    """model=hf (Llama): split by its config's base_model_tp_plan (8 heads, 4 KV heads, intermediate 172,
    vocabulary 512 over 2 ranks), each rank loading its slices; the pretrained weights (not a fresh
    initialization) are trained, the same numbers as one process over 5 steps; hf/ carries the folder's generation
    config. The model is a tiny Llama of stories260K's widths written by the test session."""
    common = pretrained_overrides(generated_data)
    _launch_checked(tmp_path / "tp", common + ["strategy=tp", "export.hf_at_end=true"], 2, "tp", 1)
    check_generation_config([tmp_path / "tp" / "hf"], generated_data.model)
    check_parity(f"tp pretrained ({generated_data.name}) ws2", metrics(tmp_path / "tp"),
                  metrics(pretrained_reference), steps=5)
    check_pretrained_loaded(tmp_path / "tp", generated_data, common, f"tp pretrained ({generated_data.name})")
