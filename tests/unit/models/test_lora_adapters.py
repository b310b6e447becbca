"""models/lora.py on tiny models of several architectures: the merged export equals peft's own merge, the adapter
folder loads with PeftModel.from_pretrained, initial values are seeded per tensor, and every peft=lora problem is
reported before any process group starts."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from models import lora
from tests import archs
from tessera.errors import ConfigError
from trainer.run.build import check


def _peft(**kw):
    p = dict(name="lora", r=4, alpha=8.0, dropout=0.0, target_modules=["all-linear"], modules_to_save=[],
             adapter=None, quantization="none")
    p.update(kw)
    return SimpleNamespace(**p)


def _random_adapted(arch: str, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(archs.make_config(arch)).float().eval()
    model = copy.deepcopy(base)
    adapters = lora.inject(model, _peft(**kw))
    with torch.no_grad():  # B is zero at init: give every trained tensor values that change the output
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return base, model.eval(), adapters


# gpt2: Conv1D layers (fan_in_fan_out); qwen2: biased q/k/v projections; llama: a fully trained embedding copy
@pytest.mark.parametrize("arch,extra", [("llama", {"modules_to_save": ["embed_tokens"]}), ("gpt2", {}),
                                        ("qwen2", {"target_modules": ["q_proj", "v_proj"]})])
def test_the_merged_export_equals_peft_merge_and_the_adapter_folder_loads(arch, extra, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.exporting.hf_folder import write_adapter_folder

    base, model, adapters = _random_adapted(arch, **extra)
    adapter = {}
    merged = dict(adapters.export_streams(lora.full_tensors(model), adapter))
    assert sorted(merged) == sorted(n for n, _ in lora.full_tensors(base))  # the base's names, nothing of peft's
    ids = torch.randint(0, archs.VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        dense = AutoModelForCausalLM.from_config(archs.make_config(arch)).float().eval()
        dense.load_state_dict(merged, strict=False)
        assert (dense(ids).logits - expected).abs().max() < 1e-5
        # peft's own merge of the same layers gives the same weights
        for module_name, module in model.named_modules():
            if module_name in adapters.layers:
                module.merge(adapter_names=[lora.ADAPTER])
                assert torch.allclose(module.base_layer.weight, merged[module_name + ".weight"], atol=1e-6)
        write_adapter_folder(adapters, tmp_path / "adapter", adapter, None)
        loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter").eval()
        assert (loaded(ids).logits - expected).abs().max() < 1e-5


def test_initial_values_are_seeded_per_tensor_and_start_as_the_base():
    _, _, adapters = _random_adapted("llama")
    first, again = adapters.initial_values(7), adapters.initial_values(7)
    other = adapters.initial_values(8)
    assert sorted(first) == sorted(n for n in adapters.trainable if ".lora_" in n)
    for name, value in first.items():
        assert torch.equal(value, again[name])
        if ".lora_B." in name:
            assert not value.any()  # B = 0: the adapted model starts as the base
        else:
            bound = 1 / value.shape[1] ** 0.5  # kaiming-uniform with a = sqrt(5), as peft draws A
            assert value.abs().max() <= bound and value.std() > bound / 3
            assert not torch.equal(value, other[name])
    # each tensor has its own generator: the values do not depend on which tensors are drawn before it
    a_names = [n for n in first if ".lora_A." in n]
    assert not torch.equal(first[a_names[0]], first[a_names[1]])


def test_initial_units_put_the_base_values_under_the_adapted_names():
    _, model, adapters = _random_adapted("llama", modules_to_save=["embed_tokens"])
    embed = torch.randn(archs.VOCAB, archs.HIDDEN)
    q = torch.randn(archs.HIDDEN, archs.HIDDEN)
    units = list(adapters.initial_units([{"model.embed_tokens.weight": embed,
                                          "model.layers.0.self_attn.q_proj.weight": q}], {"x": torch.zeros(1)}))
    assert units[-1] == {"x": torch.zeros(1)}
    first = units[0]
    assert set(first) == {"model.embed_tokens.original_module.weight",
                          "model.embed_tokens.modules_to_save.default.weight",
                          "model.layers.0.self_attn.q_proj.base_layer.weight"}
    assert first["model.embed_tokens.modules_to_save.default.weight"] is embed
    names = dict(model.named_parameters())
    assert all(n in names for n in first)


# ---- problems before any process group -------------------------------------------------------------------------
def _problems(compose, overrides, world_size=1):
    with pytest.raises(ConfigError) as info:
        check(compose(overrides), world_size)
    return info.value.problems


def _one(problems, *needles):
    hits = [p for p in problems if all(n in p for n in needles)]
    assert len(hits) == 1, (needles, problems)


def test_lora_problems_are_reported_together(compose, tmp_path):
    problems = _problems(compose, ["peft=lora", "peft.target_modules=[q_proj]", "peft.modules_to_save=[embeddings]",
                                   "peft.quantization=nf4", "strategy=fsdp", f"peft.adapter={tmp_path}"],
                         world_size=2)
    _one(problems, "peft.modules_to_save names 'embeddings'", "no module of llama")
    _one(problems, "peft.quantization=nf4 quantizes a pretrained base", "model=hf")
    _one(problems, "peft.quantization=nf4 (QLoRA) is available with strategy=single or ddp", "strategy=fsdp")
    _one(problems, f"peft.adapter={str(tmp_path)!r} is not a PEFT adapter folder")
    assert len(problems) == 4, problems
    # values peft cannot build adapters from: reported once, by key
    problems = _problems(compose, ["peft=lora", "peft.dropout=1.5", "peft.r=0"])
    _one(problems, "peft.dropout=1.5")
    _one(problems, "peft.r=0")
    assert len(problems) == 2, problems


def test_peft_keys_need_peft_lora_and_a_tied_head_stays_untouched(compose):
    _one(_problems(compose, ["peft.modules_to_save=[lm_head]"]), "peft.modules_to_save", "peft=lora only")
    problems = _problems(compose, ["peft=lora", "model.tie_word_embeddings=true", "peft.target_modules=[lm_head]"])
    _one(problems, "ties its output head to the input embedding", "lm_head")


@pytest.mark.parametrize("arch,adapted", [
    # peft maps all-linear (transformers 4's expert projections and router) onto the fused 3-D experts
    ("qwen3_moe", "model.layers.*.mlp.experts.down_proj, model.layers.*.mlp.experts.gate_up_proj, "
                  "model.layers.*.mlp.gate.weight"),
    # a router subclassing nn.Linear that returns (scores, logits): peft's layer would fail in the first forward
    ("llama4", "model.layers.*.feed_forward.router"),
])
def test_lora_on_the_fused_experts_or_a_router_is_refused_and_attention_adapters_pass(arch, adapted):
    def problems(targets):
        peft = SimpleNamespace(name="lora", adapter=None, r=4, alpha=8, dropout=0.0, target_modules=targets,
                               modules_to_save=[])
        return lora.model_problems(SimpleNamespace(peft=peft), archs.make_config(arch))

    refused = problems(["all-linear"])
    assert len(refused) == 1 and f"({adapted}: the fused experts or the router)" in refused[0], refused
    assert "peft.target_modules=[q_proj,k_proj,v_proj,o_proj]" in refused[0]
    assert problems(["q_proj", "k_proj", "v_proj", "o_proj"]) == []


def test_pipeline_parallelism_refuses_lora(compose):
    _one(_problems(compose, ["peft=lora", "strategy=pp", "model.num_layers=4"], world_size=2),
         "peft=lora is not available with tensor or pipeline parallelism", "pipeline degree 2")


def test_a_checkpoint_of_the_other_kind_or_other_adapters_is_refused():
    from trainer.checkpoint.manager import compatibility_problems

    cfg = SimpleNamespace(strategy=SimpleNamespace(name="single"))
    mine = {"method": "lora", "r": 4, "alpha": 8.0, "modules": ["a"], "modules_to_save": []}
    full = compatibility_problems({}, cfg, {}, "", True, peft=mine)
    assert len(full) == 1 and "holds the whole model and this run trains LoRA adapters" in full[0]
    adapters_only = compatibility_problems({"peft": mine}, cfg, {}, "", True, peft=None)
    assert "holds LoRA adapters only (r=4)" in adapters_only[0] and "set peft=lora" in adapters_only[0]
    other = compatibility_problems({"peft": dict(mine, alpha=16.0)}, cfg, {}, "", True, peft=mine)
    assert "differ from this run's in alpha (checkpoint: alpha=16.0)" in other[0]


def test_qlora_is_refused_where_bitsandbytes_has_no_4bit_kernels(compose, monkeypatch):
    """The 4-bit round trip is tried on the run's device: it works on this CPU; where bitsandbytes raises (a
    device without kernels, stood in for by a patched quantizer) the run is refused naming the key."""
    import bitsandbytes.functional as bnbf

    assert lora.quantization_problems(torch.device("cpu")) == []

    def no_kernel(*args, **kwargs):
        raise NotImplementedError("no 4-bit kernel for this device")

    with monkeypatch.context() as patch:
        patch.setattr(bnbf, "quantize_4bit", no_kernel)
        problems = lora.quantization_problems(torch.device("cpu"))
    assert len(problems) == 1 and "peft.quantization=nf4: bitsandbytes has no 4-bit support on cpu" in problems[0]
    _one(_problems(compose, ["peft=lora", "peft.quantization=nf4", "strategy=zero2"], world_size=2),
         "(QLoRA) is available with strategy=single or ddp", "strategy=zero2")


def test_base_only_runs_the_base_model_and_puts_everything_back():
    """The live reference of a LoRA run (objective.reference=on_the_fly): with adapters and a fully trained
    embedding copy (modules_to_save) changed, base_only gives the base model's logits bit for bit; afterwards the
    adapters act again, the model is in train mode and the same parameters require gradients."""
    base, model, _ = _random_adapted("llama", modules_to_save=["embed_tokens"], dropout=0.1)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    model.train()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        off = lora.Adapters.base_only(model, lambda: model(ids).logits)
        assert torch.equal(off, base(ids).logits)
        assert model.training and [n for n, p in model.named_parameters() if p.requires_grad] == trainable
        model.eval()
        assert not torch.allclose(model(ids).logits, off, atol=1e-3)  # the adapters are back on
