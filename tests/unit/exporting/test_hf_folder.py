"""trainer/exporting/hf_folder.py: an export from a process that never imported DeepSpeed does not import it
(accelerate's unwrap in save_pretrained would, for an isinstance test: about 0.35 s of CPU per export), and the
folder is the same as where DeepSpeed is imported (a ZeRO run), where accelerate's own check is left alone; a
streamed export writes the folder save_pretrained writes (config.json's architectures, the generation config)."""
from __future__ import annotations

import sys

import accelerate.utils.other as accelerate_other
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models.tokenizer import embedded_tokenizer
from trainer.exporting.hf_folder import exported_config, write_hf_folder, write_hf_folder_streaming


@pytest.fixture
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_an_export_imports_deepspeed_only_where_the_process_had_it(tmp_path, model, monkeypatch):
    import deepspeed  # imported, as in a ZeRO run

    assert deepspeed.__name__ in sys.modules
    check = accelerate_other.is_deepspeed_available
    write_hf_folder(model, embedded_tokenizer(), str(tmp_path / "zero"))
    with monkeypatch.context() as patch:  # a process that never imported DeepSpeed (restored afterwards)
        patch.delitem(sys.modules, "deepspeed")
        write_hf_folder(model, embedded_tokenizer(), str(tmp_path / "plain"))
        assert "deepspeed" not in sys.modules
    assert accelerate_other.is_deepspeed_available is check  # put back
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "zero" / name).read_bytes(), name


def test_a_streamed_export_writes_the_files_save_pretrained_writes(tmp_path, model):
    """A preset's config has no `architectures` (vLLM refuses such a folder); a source's may name its base model:
    the streamed folder's config.json names the causal LM class as save_pretrained's does, and its generation config
    is the model's. The live config is left as it was."""
    import json

    tok = embedded_tokenizer()
    assert model.config.architectures is None
    write_hf_folder(model, tok, str(tmp_path / "whole"))
    model.config.architectures = None  # save_pretrained set it on the live config
    model.generation_config.temperature, model.generation_config.do_sample = 0.5, True
    write_hf_folder_streaming(model.config, tok, str(tmp_path / "streamed"), model.state_dict().items(), writer=True,
                              generation_config=model.generation_config)
    assert model.config.architectures is None
    whole, streamed = (json.loads((tmp_path / f / "config.json").read_text()) for f in ("whole", "streamed"))
    assert streamed["architectures"] == whole["architectures"] == ["LlamaForCausalLM"]
    assert streamed == whole
    generation = json.loads((tmp_path / "streamed" / "generation_config.json").read_text())
    assert generation["temperature"] == 0.5 and generation["do_sample"] is True

    model.config.architectures = ["LlamaModel"]  # a base model's folder fine-tuned as a causal LM
    assert exported_config(model.config).architectures == ["LlamaForCausalLM"]
    assert model.config.architectures == ["LlamaModel"]
    unknown = type("RemoteConfig", (LlamaConfig,), {})(architectures=["MyForCausalLM"])  # remote code
    assert exported_config(unknown) is unknown


@pytest.mark.parametrize("arch", ["llama_tied", "gpt_neox", "mixtral"])
def test_a_streamed_export_holds_the_tensors_save_pretrained_writes(tmp_path, arch):
    """The model's full tensors, streamed, are written in transformers' checkpoint layout as save_pretrained writes
    them: a tied head once, GPT-NeoX's lm_head as embed_out, Mixtral's fused experts as per-expert tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.archs import make_model_folder

    source = make_model_folder(arch, tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(source)
    write_hf_folder_streaming(model.config, embedded_tokenizer(), str(tmp_path / "streamed"),
                              ((n, p.detach()) for n, p in model.state_dict().items()), writer=True)
    want, got = load_file(source / "model.safetensors"), load_file(tmp_path / "streamed" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
