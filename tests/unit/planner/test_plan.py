"""The preflight planner (trainer/planner/): formulas per strategy, activation estimates, checks and the CLI."""
from __future__ import annotations

import pytest

from models import registry
from models.tokenizer import embedded_tokenizer
from tests.conftest import compose_config
from trainer.planner import estimate as P

MODEL = ["model.hidden_size=128", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
         "model.intermediate_size=256", "data.embedded_documents=50", "data.seq_len=32", "train.micro_batch_size=1",
         "train.global_batch_size=8"]


def _est(overrides, world):
    cfg = compose_config(MODEL + list(overrides))
    info = registry.describe(cfg.model, embedded_tokenizer())
    return P.estimate(cfg, world, info), cfg, info


def _psi():
    est, cfg, info = _est(["strategy=single"], 1)
    return P.count_parameters_total(info)


def test_replicated_strategies_hold_16_bytes_per_parameter():
    psi = _psi()
    for strategy, world in (("single", 1), ("ddp", 2), ("ddp", 4)):
        est, _, _ = _est([f"strategy={strategy}"], world)
        assert (est.params, est.grads, est.optimizer, est.master_params) == (4 * psi, 4 * psi, 8 * psi, 0)
    est, _, _ = _est(["strategy=ddp", "optim=sgd", "optim.momentum=0"], 2)
    assert est.model_states == 8 * psi


def test_diloco_adds_its_anchor_and_outer_momentum():
    psi = _psi()
    ddp, _, _ = _est(["strategy=ddp"], 2)
    diloco, _, _ = _est(["strategy=ddp", "sync=diloco"], 2)
    overlap, _, _ = _est(["strategy=ddp", "sync=diloco", "sync.overlap=true"], 2)
    local, _, _ = _est(["strategy=ddp", "sync=local_sgd"], 2)
    assert diloco.model_states - ddp.model_states == 8 * psi  # anchor + momentum
    assert overlap.model_states - ddp.model_states == 12 * psi  # + the weights of the round in flight
    assert local.model_states == ddp.model_states
    # hsdp: each replica group a worker; the anchor and momentum are sharded like the parameters
    hsdp, _, _ = _est(["strategy=hsdp", "strategy.dp_shard=2"], 4)
    hsdp_diloco, _, _ = _est(["strategy=hsdp", "strategy.dp_shard=2", "sync=diloco"], 4)
    assert hsdp_diloco.model_states - hsdp.model_states == pytest.approx(8 * psi / 2)


def test_sharded_strategies_divide_by_the_shard_degree():
    psi = _psi()
    for world in (2, 4):
        est, _, _ = _est(["strategy=fsdp", "precision=bf16"], world)
        assert est.model_states == pytest.approx(16 * psi / world)
        assert est.buffers > 0  # a block gathered in bf16 (and the next prefetched)
    hsdp, _, _ = _est(["strategy=hsdp", "strategy.dp_shard=2"], 4)
    assert hsdp.model_states == pytest.approx(16 * psi / 2)  # sharded over 2, replicated twice
    keep, _, _ = _est(["strategy=fsdp", "strategy.reshard_after_forward=false", "precision=bf16"], 4)
    assert keep.buffers == pytest.approx(2 * psi / 4 * 4)  # every gathered bf16 parameter kept to backward
    off, _, _ = _est(["strategy=fsdp"], 2)  # (the CPU device check is not the planner's business)
    assert off.host_params == 0


def test_zero_stages():
    psi = _psi()
    z1, _, _ = _est(["strategy=zero1", "precision=bf16"], 4)
    assert (z1.params, z1.master_params, z1.optimizer) == (2 * psi, 4 * psi / 4, 8 * psi / 4)
    z3, cfg, info = _est(["strategy=zero3", "precision=bf16"], 4)
    largest = P.count_parameters(__import__("models.init").init.meta_model(info.hf_config)).largest_param
    assert z3.params == pytest.approx(2 * psi / 4)
    assert z3.buffers >= 2 * largest  # a gathered parameter is transient: a buffer, not a model state
    off, _, _ = _est(["strategy=zero3_offload", "precision=bf16"], 4)
    assert off.params == off.optimizer == off.master_params == 0 and off.host_params > 0
    assert off.device_total < z3.device_total


def test_model_parallel_layouts():
    psi = _psi()
    tp, _, _ = _est(["strategy=tp"], 2)
    assert 4 * psi / 2 < tp.params < 4 * psi  # norms stay whole
    pp, _, _ = _est(["strategy=pp"], 2)
    assert pp.params == pytest.approx(4 * psi / 2, rel=0.1)  # half of the layers, embeddings or head


def test_activations_follow_sequence_batch_checkpointing_and_pipeline_depth():
    base, _, _ = _est(["strategy=single"], 1)
    longer, _, _ = _est(["strategy=single", "data.seq_len=64"], 1)
    assert longer.activations == pytest.approx(2 * base.activations, rel=1e-6)
    ckpt, _, _ = _est(["strategy=single", "train.activation_checkpointing=full"], 1)
    assert ckpt.activations < base.activations
    gpipe, _, _ = _est(["strategy=pp", "strategy.pp_schedule=gpipe"], 2)
    one_f_one_b, _, _ = _est(["strategy=pp", "strategy.pp_schedule=1f1b"], 2)
    assert gpipe.activations > one_f_one_b.activations  # all 8 micro-batches in flight vs 2


def test_problems_are_reported_and_feasible_strategies_sorted():
    est, cfg, info = _est(["strategy=tp", "strategy.tp=3"], 3)
    assert any("must divide the attention heads" in p for p in est.problems)
    rows, invalid = P.feasible(cfg, 2, info, device_gib=1.0)
    totals = [r[0] for r in rows]
    assert totals == sorted(totals) and {r[1] for r in rows} >= {"ddp", "fsdp", "zero3", "tp", "pp"}
    assert ("single", ) == tuple(n for n, _ in invalid if n == "single")


def test_cli(capsys):
    assert P.main(MODEL + ["strategy=fsdp", "plan.world_size=2", "plan.device_memory=1"]) == 0
    out = capsys.readouterr().out
    assert "model states" in out and "device memory 1 GiB: fits" in out and "cheapest first" in out
    assert P.main(MODEL + ["strategy=tp", "strategy.tp=3", "plan.world_size=3"]) == 2  # config problems: 2
    assert "checks: FAIL" in capsys.readouterr().out
    assert P.main(["strategy.bogus_key=1"]) == 2
    assert "error:" in capsys.readouterr().err
    assert P.main(MODEL + ["strategy=ddp", "plan.world_size=2", "plan.device_memory=0.000001"]) == 1  # no fit
    assert "does NOT fit" in capsys.readouterr().out


def test_layout_refusals_of_a_model_are_reported_before_launch(tmp_path, capsys):
    """A model the layout can't split (OPT: no tensor-parallel plan; a transformers plan style Tessera does not
    apply) fails the planner's checks with the message training would give, before any process group."""
    from transformers import OPTConfig, OPTForCausalLM

    folder = tmp_path / "opt"
    tok = embedded_tokenizer()
    OPTForCausalLM(OPTConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                             word_embed_proj_dim=64, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(folder)
    tok.save_pretrained(folder)
    overrides = ["model=hf", f"model.name_or_path={folder}", "data.embedded_documents=50", "data.seq_len=32",
                 "train.micro_batch_size=1", "train.global_batch_size=8"]
    assert P.main(overrides + ["strategy=tp", "plan.world_size=2"]) == 2
    out = capsys.readouterr().out
    assert "checks: FAIL" in out and "opt architecture has no tensor-parallel plan" in out
    assert P.main(overrides + ["strategy=pp", "plan.world_size=2"]) == 0  # its pipeline split is derived
    capsys.readouterr()


def test_context_parallelism_divides_activations_and_shards_over_data_x_context(capsys):
    """strategy.cp=2 on 4 ranks: each rank keeps half the activations of the same micro-batch, and FSDP shards
    the parameters over all 4 (2 data x 2 context) ranks; the report names the context ranks."""
    psi = _psi()
    fsdp, _, _ = _est(["strategy=fsdp"], 4)
    cp, _, _ = _est(["strategy=fsdp", "strategy.cp=2"], 4)
    assert not cp.problems, cp.problems
    assert cp.activations == pytest.approx(fsdp.activations / 2)
    assert cp.params == pytest.approx(fsdp.params) == pytest.approx(4 * psi / 4)
    pure, _, _ = _est(["strategy=fsdp", "strategy.cp=2"], 2)
    assert pure.params == pytest.approx(4 * psi / 2) and pure.buffers > 0  # a data-parallel degree of 1, sharded
    assert P.main(MODEL + ["strategy=fsdp", "strategy.cp=2", "plan.world_size=2"]) == 0
    assert "over 2 context ranks (ulysses)" in capsys.readouterr().out


def test_expert_parallelism_gathers_a_share_of_each_blocks_experts(tmp_path):
    """A tiny Mixtral under fsdp on 2 ranks: the same sharded states with and without strategy.ep=2, the
    gathered-block buffer smaller by half of a block's experts (x 2 blocks: in use and prefetched); a dense model
    is refused with the message training gives."""
    from tests.archs import make_model_folder

    make_model_folder("mixtral", tmp_path / "mixtral", seed=0)
    model = ["model=hf", f"model.name_or_path={tmp_path / 'mixtral'}", "data.seq_len=32"]
    cfg = compose_config(model + ["strategy=fsdp"])
    info = registry.describe(cfg.model, registry.load_tokenizer(cfg.model))
    base = P.estimate(cfg, 2, info)
    ep = P.estimate(compose_config(model + ["strategy=fsdp", "strategy.ep=2"]), 2, info)
    assert not ep.problems, ep.problems
    assert (ep.params, ep.grads, ep.optimizer) == (base.params, base.grads, base.optimizer)
    experts = P.count_parameters(P.meta_adapted(info.hf_config, cfg.peft)).block_experts
    assert experts == 4 * 3 * 64 * 128  # 4 experts of gate, up and down projections
    assert base.buffers - ep.buffers == pytest.approx(2 * 4 * experts / 2)
    dense, _, _ = _est(["strategy=fsdp", "strategy.ep=2"], 2)
    assert any("needs a mixture-of-experts model" in p for p in dense.problems)
    # Beside tensor parallelism (4 ranks, tp=2) the experts stay whole on each tp rank: the sharded parameters are
    # what memory.json measured for this model (879,744 B per rank, with and without ep=2), and ep=2 still
    # gathers half of each block's experts.
    tp_model = model + ["strategy=fsdp_tp", "strategy.tp=2"]
    tp_plain = P.estimate(compose_config(tp_model), 4, info)
    tp_ep = P.estimate(compose_config(tp_model + ["strategy.ep=2"]), 4, info)
    assert not tp_ep.problems and tp_plain.params == tp_ep.params == 879_744
    assert tp_plain.buffers - tp_ep.buffers == pytest.approx(2 * 4 * experts / 2)


def test_preference_pairs_double_the_rows_and_a_live_reference_holds_the_model_again():
    """data=preference: a micro-batch of pairs is twice the rows; objective.reference=on_the_fly holds a frozen copy
    of the model as the model is held (FSDP: its shards), nothing more with LoRA (the base with adapters off)."""
    pairs = ["data=preference", "data.path=p.jsonl", "objective=dpo"]
    for strategy, world in (("single", 1), ("fsdp", 2), ("zero3", 4)):
        lm, _, _ = _est([f"strategy={strategy}"], world)
        offline, _, _ = _est([f"strategy={strategy}", *pairs], world)
        live, _, _ = _est([f"strategy={strategy}", *pairs, "objective.reference=on_the_fly"], world)
        assert offline.activations == pytest.approx(2 * lm.activations, rel=1e-6) and offline.reference == 0
        assert live.reference == offline.params > 0 and live.device_total == offline.device_total + offline.params
    lora, _, _ = _est(["strategy=fsdp", "peft=lora", *pairs, "objective.reference=on_the_fly"], 2)
    simpo, _, _ = _est(["strategy=fsdp", *pairs, "objective=simpo"], 2)
    assert lora.reference == 0 and simpo.reference == 0


def test_a_state_space_model_without_attention_heads_is_planned_and_refused_where_it_cannot_split(tmp_path, capsys):
    """Mamba has no attention heads (num_attention_heads unset): the planner estimates it, and tensor and context
    parallelism refuse it with their messages, not a TypeError from a head count of None."""
    from transformers import MambaConfig, MambaForCausalLM

    folder = tmp_path / "mamba"
    tok = embedded_tokenizer()
    MambaForCausalLM(MambaConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, state_size=8,
                                 pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                 eos_token_id=tok.eos_token_id)).save_pretrained(folder)
    tok.save_pretrained(folder)
    overrides = ["model=hf", f"model.name_or_path={folder}", "data.embedded_documents=50", "data.seq_len=32",
                 "train.micro_batch_size=1", "train.global_batch_size=8"]
    assert P.main(overrides + ["strategy=fsdp", "plan.world_size=2"]) == 0
    assert "activations" in capsys.readouterr().out
    assert P.main(overrides + ["strategy=tp", "plan.world_size=2"]) == 2
    assert "mamba architecture has no tensor-parallel plan" in capsys.readouterr().out
    assert P.main(overrides + ["strategy=fsdp", "strategy.cp=2", "plan.world_size=2"]) == 2
    assert "the mamba model mixes tokens outside attention" in capsys.readouterr().out
