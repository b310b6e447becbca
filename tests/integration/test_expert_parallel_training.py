"""Expert parallelism (strategy.ep) end to end with real processes on gloo, on the tiny Mixtral of the matrix: the
experts split over 2 of 4 FSDP ranks, beside context parallelism, under hsdp and beside tensor parallelism train the
one-process curve in fp32 (loss and gradient norm within 1e-6 relative); a checkpoint written at ep=2 resumes at ep=1
(plain fsdp) and at ep=4 (one expert per rank) and continues the curve; a rank gathers only its share of each block's
experts, as the planner says; the router's load-balancing loss counts once (cp x ep, ZeRO-2). (Every MoE
architecture under ep=2 and the dense ones' refusal: test_architectures' `ep` layout; the expert dispatch against
one process, block by block: tests/unit/parallel/test_expert_parallel.py.)"""
from __future__ import annotations

import json

import pytest

from tests.archs import make_model_folder
from tests.integration.conftest import check_parity, launch, metrics, ok

STEPS = 4


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ep-mixtral") / "mixtral"
    make_model_folder("mixtral", folder, seed=0)
    return folder


def _overrides(model, extra=()):
    return ["model=hf", f"model.name_or_path={model}", "data.embedded_documents=400", "data.seq_len=32",
            "scheduler.warmup_steps=1", "logging.progress=false", f"train.max_steps={STEPS}", "train.log_every=1",
            "train.global_batch_size=8", "train.micro_batch_size=2", "eval.every=0", "eval.at_end=false",
            "export.hf_at_end=false", "checkpoint.at_end=false", *extra]


@pytest.fixture(scope="module")
def reference(mixtral, tmp_path_factory):
    run = tmp_path_factory.mktemp("ep-single")
    ok(launch("python", _overrides(mixtral, ["strategy=single"]), run))
    return metrics(run)


CASES = {
    "fsdp4_x_ep2": ["strategy=fsdp", "strategy.ep=2"],
    "cp2_x_ep2": ["strategy=fsdp", "strategy.cp=2", "strategy.ep=2"],
    "hsdp2x2_x_ep2": ["strategy=hsdp", "strategy.dp_replicate=2", "strategy.dp_shard=2", "strategy.ep=2"],
    # attention split over tp; each tp rank of an expert rank holds its experts (an (ep, tp) mesh, Replicate on tp)
    "fsdp2_x_tp2_x_ep2": ["strategy=fsdp_tp", "strategy.tp=2", "strategy.ep=2"],
}


@pytest.mark.parametrize("name", CASES)
def test_expert_parallelism_trains_the_one_process_curve(mixtral, reference, tmp_path, name):
    ok(launch("torchrun", _overrides(mixtral, CASES[name]), tmp_path, nproc=4))
    check_parity(f"ep {name}", metrics(tmp_path), reference, steps=STEPS)


def test_bf16_under_expert_parallelism_is_one_process_bf16(mixtral, reference, tmp_path):
    """precision=bf16 at ep=2 (FSDP casts what it gathers, the experts' shards too): the curve of one process in
    bf16 within bf16 rounding, and away from fp32's."""
    runs = {}
    for name, launcher, nproc, extra in (("single", "python", 1, ["strategy=single"]),
                                         ("ep2", "torchrun", 2, ["strategy=fsdp", "strategy.ep=2"])):
        runs[name] = tmp_path / name
        ok(launch(launcher, _overrides(mixtral, [*extra, "precision=bf16"]), runs[name], nproc=nproc))
    recs, base = metrics(runs["ep2"]), metrics(runs["single"])
    errors = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(recs, base)]
    assert len(recs) == STEPS and max(errors) < 2e-2, errors
    from_fp32 = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(recs, reference))
    assert from_fp32 > 1e-5, from_fp32  # it computed in bf16


def test_a_checkpoint_reshards_between_expert_degrees(mixtral, reference, tmp_path):
    """Saved at step 2 with the experts split 2 ways; resumed with them whole on every FSDP rank (ep=1) and split
    4 ways: steps 3 and 4 are the one-process run's."""
    first = tmp_path / "ep2"
    ok(launch("torchrun", _overrides(mixtral, ["strategy=fsdp", "strategy.ep=2", "checkpoint.every=2"]), first,
              nproc=2))
    check_parity("ep2", metrics(first), reference, steps=STEPS)
    ref = {r["step"]: r for r in reference}
    for name, nproc, extra in (("ep1", 2, ["strategy=fsdp"]), ("ep4", 4, ["strategy=fsdp", "strategy.ep=4"])):
        resumed = tmp_path / name
        ok(launch("torchrun", _overrides(mixtral, [*extra, f"checkpoint.resume={first}/checkpoints/step_2"]),
                  resumed, nproc=nproc))
        recs = metrics(resumed)
        assert [r["step"] for r in recs] == [3, 4], (name, recs)
        for r in recs:
            assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=1e-6), name
            assert r["grad_norm"] == pytest.approx(ref[r["step"]]["grad_norm"], rel=1e-6), name


def test_a_rank_gathers_only_its_share_of_the_experts_as_planned(mixtral, tmp_path):
    """memory.json on 2 ranks: the sharded parameters, gradients and optimizer state per rank are the same with
    and without ep (FSDP already shards the experts 2 ways), but the parameters a block gathers for its forward
    drop by exactly half of one block's experts at ep=2 (the other half stays on the other rank and the tokens
    travel instead); the planner's gathered-block estimate drops by the same bytes per block it counts."""
    from models import registry
    from trainer.config.compose import compose
    from trainer.planner.estimate import count_parameters, estimate

    ranks, planned = {}, {}
    for ep in (1, 2):
        overrides = _overrides(mixtral, ["strategy=fsdp", f"strategy.ep={ep}", "logging.memory_report=true",
                                         "train.max_steps=1"])
        ok(launch("torchrun", overrides, tmp_path / f"ep{ep}", nproc=2))
        ranks[ep] = json.loads((tmp_path / f"ep{ep}" / "memory.json").read_text())["ranks"]
        cfg = compose(overrides)
        info = registry.describe(cfg.model, registry.load_tokenizer(cfg.model))
        planned[ep] = estimate(cfg, 2, info).buffers
    from models.init import meta_model

    experts = count_parameters(meta_model(info.hf_config)).block_experts
    assert experts > 0
    for r1, r2 in zip(ranks[1], ranks[2]):
        for key in ("params", "grads", "optimizer"):
            assert r1[key] == r2[key], (key, r1[key], r2[key])
        assert r1["gathered"] - r2["gathered"] == 4 * experts // 2, (r1["gathered"], r2["gathered"], experts)
    blocks_counted = 2  # the planner counts the block in use and the one prefetched
    assert planned[1] - planned[2] == pytest.approx(blocks_counted * 4 * experts / 2)
    print(f"gathered per rank (bytes): ep=1 {ranks[1][0]['gathered']}, ep=2 {ranks[2][0]['gathered']}; "
          f"experts per block {experts} parameters; planned buffers {planned[1]:.0f} -> {planned[2]:.0f}")


AUX = ["model.router_aux_loss_coef=0.1"]
AUX_CASES = {  # the term counted once: over context ranks (totals), expert ranks, and DeepSpeed's averaging
    "cp2_x_ep2": ("torchrun", 4, ["strategy=fsdp", "strategy.cp=2", "strategy.ep=2"]),
    "zero2": ("deepspeed", 2, ["strategy=zero2"]),
}


@pytest.fixture(scope="module")
def aux_reference(mixtral, tmp_path_factory):
    run = tmp_path_factory.mktemp("aux-single")
    ok(launch("python", _overrides(mixtral, ["strategy=single", *AUX]), run))
    return metrics(run)


@pytest.mark.parametrize("name", AUX_CASES)
def test_the_router_load_balancing_loss_counts_once_on_every_layout(mixtral, reference, aux_reference, tmp_path,
                                                                     name):
    """model.router_aux_loss_coef=0.1: the load-balancing term of each micro-batch's whole sequences, averaged over
    micro-batches and data-parallel ranks, joins the gradient; the curve and the logged term are one process's
    (whose term equals transformers' own: tests/unit/run/test_router_loss.py), and the gradient is not the one
    without the term."""
    launcher, nproc, extra = AUX_CASES[name]
    ok(launch(launcher, _overrides(mixtral, [*extra, *AUX]), tmp_path, nproc=nproc))
    recs = metrics(tmp_path)
    check_parity(f"router aux loss {name}", recs, aux_reference, steps=STEPS)
    for r, ref in zip(recs, aux_reference):
        assert r["router_aux_loss"] == pytest.approx(ref["router_aux_loss"], rel=1e-6)
        assert r["router_aux_loss"] > 1.0  # num_experts x sum f P: 1 when balanced, here about 2
    assert max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(aux_reference, reference)) > 1e-4
    assert "router_aux_loss" not in reference[0]
