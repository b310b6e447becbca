"""peft=lora end to end on a pretrained model (the generated tiny Llama): the same fp32 loss curve on every backend
that takes LoRA as on one process, adapter-only gradients, optimizer state and checkpoints, exact resume, and the
two exports (hf-adapter/ for PeftModel.from_pretrained, the merged hf/ with the adapter model's logits); QLoRA
(a 4-bit base, bitsandbytes on the CPU) trains and exports (real processes, gloo)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.integration.conftest import (
    SMALL, check_generation_config, check_parity, export_command, launch, metrics, ok, read_jsonl, rel_err)

STEPS = 4
# Every backend reorders the same fp32 sums; the bar is 1e-4 relative, and they meet 1e-6.
LORA_TOL = 1e-6
LAYOUTS = {  # name -> (launcher, ranks, overrides)
    "ddp": ("torchrun", 2, ["strategy=ddp"]),
    # ZeRO through torchrun (the deepspeed launcher adds two Python processes that import torch and DeepSpeed to
    # each launch and changes nothing for the adapters; test_launchers.py and test_deepspeed.py cover it)
    "zero1": ("torchrun", 2, ["strategy=zero1"]),
    "zero2": ("torchrun", 2, ["strategy=zero2"]),
    "zero3": ("torchrun", 2, ["strategy=zero3"]),
    "zero3_offload": ("torchrun", 2, ["strategy=zero3_offload"]),
    "fsdp": ("torchrun", 2, ["strategy=fsdp"]),
    "hsdp": ("torchrun", 4, ["strategy=hsdp", "strategy.dp_replicate=2", "strategy.dp_shard=2"]),
}


def _overrides(source, *extra):
    return [o for o in SMALL if not o.startswith(("model.", "data.seq_len"))] + [
        "model=hf", f"model.name_or_path={source.model}", "data=text", f"data.path={source.text}", "data.seq_len=64",
        "peft=lora", "peft.r=4", "peft.alpha=8", f"train.max_steps={STEPS}", "train.log_every=1",
        "train.global_batch_size=8", "train.micro_batch_size=2", "eval.every=0", "eval.at_end=false",
        "checkpoint.every=2", "checkpoint.at_end=false", "optim.lr=1e-2", *extra]


@pytest.fixture(scope="module")
def single(generated_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("lora-single")
    ok(launch("python", _overrides(generated_data, "strategy=single"), run))
    return run


def _trainable(model):
    return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}


def test_only_the_adapters_train_and_checkpoint(generated_data, single):
    from models import lora
    from transformers import AutoConfig

    from tests.conftest import compose_config

    cfg = compose_config(_overrides(generated_data, "strategy=single"))
    model = lora.meta_adapted(AutoConfig.from_pretrained(generated_data.model), cfg.peft)
    trainable = _trainable(model)
    total = sum(p.numel() for p in model.parameters())
    assert trainable and all(".lora_" in n for n in trainable)
    n_adapter = sum(trainable.values())
    # the checkpoint's tensors: the adapters and their two AdamW moments (fp32), nothing of the frozen base
    meta = json.loads((single / "checkpoints" / "step_2" / "meta.json").read_text())
    assert meta["peft"]["r"] == 4 and len(meta["peft"]["modules"]) == 7 * 2  # all-linear: 7 per Llama block
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(single / "checkpoints" / "step_2")).read_metadata().state_dict_metadata
    model_keys = sorted(k[len("model."):] for k in saved if k.startswith("model."))
    assert model_keys == sorted(trainable)
    optim_keys = {k for k in saved if k.startswith("optim.")}
    assert {k.split(".", 1)[1].rsplit(".", 1)[0] for k in optim_keys} == set(trainable)
    def nbytes(keys):
        return sum(saved[k].size.numel() * saved[k].properties.dtype.itemsize for k in keys)

    assert nbytes(k for k in saved if k.startswith("model.")) == 4 * n_adapter
    moments = [k for k in saved if k.startswith("optim.") and not k.endswith(".step")]
    assert nbytes(moments) == 8 * n_adapter  # AdamW's exp_avg and exp_avg_sq, fp32
    files = sum(os.path.getsize(p) for p in (single / "checkpoints" / "step_2").glob("*.distcp"))
    print(f"LoRA checkpoint: {files} bytes of tensor files for {n_adapter} adapter parameters of {total} "
          f"({files / (12 * total):.3f} of the {12 * total} bytes of a full fp32 + AdamW checkpoint's tensors)")
    assert files < 0.2 * 12 * total


def test_exports_load_as_a_peft_adapter_and_as_the_merged_model(generated_data, single):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(generated_data.model, dtype=torch.float32)
    base_names = sorted(base.state_dict())
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, single / "hf-adapter").eval()
        adapter_logits = adapted(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(single / "hf", dtype=torch.float32).eval()
        merged_logits = merged(ids).logits
    assert not torch.allclose(adapter_logits, base_logits, atol=1e-3)  # the adapter learned something
    err = (merged_logits - adapter_logits).abs().max().item()
    print(f"merged hf/ vs base + hf-adapter/: max logit difference {err:.2e}")
    assert err < 1e-5
    # the merged model has the base's names and nothing of peft's
    assert sorted(merged.state_dict()) == base_names
    config = json.loads((single / "hf-adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(generated_data.model)


@pytest.fixture(scope="module")
def layouts(generated_data, tmp_path_factory):
    """Every backend's run of the same config (fsdp and zero3 also export): name -> run folder."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("lora-layouts")

    def run(name):
        launcher, nproc, extra = LAYOUTS[name]
        export = name in ("fsdp", "zero3")  # the sharded exports (gathered per tensor)
        ok(launch(launcher, _overrides(generated_data, *extra, f"export.hf_at_end={str(export).lower()}"),
                  root / name, nproc=nproc, timeout=400))
        return root / name

    with ThreadPoolExecutor(2) as pool:  # the runs are mostly start-up time
        return dict(zip(LAYOUTS, pool.map(run, LAYOUTS)))


def test_lora_trains_the_same_on_every_backend(single, layouts):
    ref = metrics(single)
    for name, run in layouts.items():
        check_parity(f"lora {name}", metrics(run), ref, tol=LORA_TOL, steps=STEPS)


@pytest.mark.parametrize("name", ["fsdp", "zero3"])
def test_sharded_exports_equal_the_single_process_ones(generated_data, single, layouts, name):
    from safetensors.torch import load_file

    check_generation_config([single / "hf", layouts[name] / "hf"], generated_data.model)  # the merged model's too
    for folder, filename in (("hf-adapter", "adapter_model.safetensors"), ("hf", "model.safetensors")):
        mine, ref = load_file(layouts[name] / folder / filename), load_file(single / folder / filename)
        assert sorted(mine) == sorted(ref)
        err = max((mine[k] - ref[k]).abs().max().item() for k in ref)
        print(f"lora {name} {folder}/ vs one process: max difference {err:.2e}")
        assert err < 1e-5


@pytest.mark.parametrize("name", ["single", "fsdp", "zero2"])
def test_a_resumed_lora_run_continues_exactly(generated_data, single, layouts, tmp_path, name):
    uninterrupted = single if name == "single" else layouts[name]
    launcher, nproc, extra = ("python", 1, ["strategy=single"]) if name == "single" else LAYOUTS[name]
    shutil.copytree(uninterrupted / "checkpoints" / "step_2", tmp_path / "checkpoints" / "step_2")
    proc = launch(launcher, _overrides(generated_data, *extra, "checkpoint.resume=auto", "export.hf_at_end=false"),
                  tmp_path, nproc=nproc)
    ok(proc)
    got, ref = metrics(tmp_path), {r["step"]: r for r in metrics(uninterrupted)}
    assert [r["step"] for r in got] == [3, 4]
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(ref[r["step"]]["loss"], ref[r["step"]]["grad_norm"])
                                                          for r in got]


def test_qlora_trains_on_a_4bit_base_and_exports_its_merged_model(generated_data, tmp_path):
    """bitsandbytes holds the base in nf4 on the CPU: one process and 2 DDP ranks train the same adapters with its
    8-bit AdamW (QLoRA's optimizer), a run resumed from a checkpoint continues exactly, and the merged hf/ (the base
    dequantized plus the adapters, dense) gives the 4-bit adapter model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from models.registry import keep_training_layout

    qlora = ["peft.quantization=nf4", "eval.every=2", "optim=adamw_8bit"]
    ok(launch("python", _overrides(generated_data, "strategy=single", *qlora), tmp_path / "single"))
    # the checkpoint's config carries the quantization_config the 4-bit base was loaded with: a resume takes it
    shutil.copytree(tmp_path / "single" / "checkpoints" / "step_2", tmp_path / "resumed" / "checkpoints" / "step_2")
    ok(launch("python", _overrides(generated_data, "strategy=single", *qlora, "checkpoint.resume=auto",
                                   "export.hf_at_end=false"), tmp_path / "resumed"))
    resumed = metrics(tmp_path / "resumed")
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in resumed] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in metrics(tmp_path / "single") if r["step"] > 2]
    ok(launch("torchrun", _overrides(generated_data, "strategy=ddp", *qlora, "export.hf_at_end=false"),
              tmp_path / "ddp", nproc=2))
    ref = metrics(tmp_path / "single")
    check_parity("qlora ddp", metrics(tmp_path / "ddp"), ref, tol=LORA_TOL, steps=STEPS)
    assert ref[-1]["loss"] < ref[0]["loss"]
    # training went on after each evaluation (an evaluation must leave the 4-bit layers trainable)
    assert [e["step"] for e in read_jsonl(tmp_path / "single" / "eval.jsonl")] == [2, 4]

    quantized = AutoModelForCausalLM.from_pretrained(
        generated_data.model, dtype=torch.float32, device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32))
    keep_training_layout(quantized)
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(quantized, tmp_path / "single" / "hf-adapter").eval()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "single" / "hf", dtype=torch.float32).eval()
        err = (merged(ids).logits - adapted(ids).logits).abs().max().item()
    print(f"qlora merged hf/ vs 4-bit base + hf-adapter/: max logit difference {err:.2e}")
    assert err < 1e-5
    assert "quantization_config" not in json.loads((tmp_path / "single" / "hf" / "config.json").read_text())


@pytest.mark.parametrize("name", ["single", "zero2"])
def test_exporting_a_lora_checkpoint_rebuilds_the_runs_exports(generated_data, single, layouts, tmp_path, name):
    """python -m trainer.export on a checkpoint that holds the adapters only (DCP; DeepSpeed's format): the base is
    read again, and the merged model and the adapter equal the run's own end-of-run export."""
    from safetensors.torch import load_file

    run = single if name == "single" else layouts[name]
    export_command(run / "checkpoints" / "step_4", tmp_path / "merged")
    check_generation_config([tmp_path / "merged"], generated_data.model)
    for folder, filename in (("merged-adapter", "adapter_model.safetensors"), ("merged", "model.safetensors")):
        got = load_file(tmp_path / folder / filename)
        ref = load_file(single / ("hf-adapter" if folder.endswith("adapter") else "hf") / filename)
        assert sorted(got) == sorted(ref)
        err = max((got[k] - ref[k]).abs().max().item() for k in ref)
        print(f"export of the lora {name} checkpoint, {folder}/ vs the run's: max difference {err:.2e}")
        assert err < (1e-7 if name == "single" else 1e-5)


def test_training_starts_from_an_adapter_folder(generated_data, single, tmp_path):
    """peft.adapter: a run (here FSDP, which reads the base and the adapter part by part) starts from the adapter
    that the single-process run exported: its first evaluation is the merged model's validation loss."""
    from transformers import AutoModelForCausalLM

    from tests.integration.conftest import val_loss

    overrides = _overrides(generated_data, "strategy=fsdp", f"peft.adapter={single / 'hf-adapter'}",
                           "eval.at_start=true", "eval.max_sequences=16", "train.max_steps=1",
                           "export.hf_at_end=false", "checkpoint.every=0")
    ok(launch("torchrun", overrides, tmp_path / "run", nproc=2))
    first = read_jsonl(tmp_path / "run" / "eval.jsonl")[0]
    merged = AutoModelForCausalLM.from_pretrained(single / "hf", dtype=torch.float32).eval()
    expected = val_loss(merged, tmp_path / "val", overrides)
    print(f"lora from an adapter folder: step-0 val loss {first['val_loss']:.6f}, merged model's {expected:.6f}")
    assert first["step"] == 0 and rel_err(first["val_loss"], expected) < 1e-5


def test_a_fully_trained_module_beside_the_adapters_trains_the_same_sharded(generated_data, tmp_path):
    """peft.modules_to_save=[embed_tokens]: peft's trained copy of the embedding (a copy of a ZeRO-3 partition, a
    module FSDP shards) follows one process's curve, and the exports carry it under the base's name."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file

    extra = ["peft.modules_to_save=[embed_tokens]", "peft.target_modules=[q_proj,v_proj]", "checkpoint.every=0"]
    runs = {"single": ("python", 1, ["strategy=single"]), "zero3": LAYOUTS["zero3"], "fsdp": LAYOUTS["fsdp"]}

    def run(name):
        launcher, nproc, more = runs[name]
        ok(launch(launcher, _overrides(generated_data, *more, *extra), tmp_path / name, nproc=nproc, timeout=400))

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run, runs))
    ref = metrics(tmp_path / "single")
    for name in ("zero3", "fsdp"):
        check_parity(f"lora + modules_to_save {name}", metrics(tmp_path / name), ref, tol=LORA_TOL, steps=STEPS)
        adapter = load_file(tmp_path / name / "hf-adapter" / "adapter_model.safetensors")
        ref_adapter = load_file(tmp_path / "single" / "hf-adapter" / "adapter_model.safetensors")
        assert "base_model.model.model.embed_tokens.weight" in adapter and sorted(adapter) == sorted(ref_adapter)
        assert max((adapter[k] - ref_adapter[k]).abs().max().item() for k in adapter) < 1e-5
    base = load_file(generated_data.model / "model.safetensors")["model.embed_tokens.weight"]
    merged = load_file(tmp_path / "single" / "hf" / "model.safetensors")["model.embed_tokens.weight"]
    assert (merged - base).abs().max() > 1e-4  # the trained copy, not the frozen original
