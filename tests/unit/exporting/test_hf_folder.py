"""trainer/exporting/hf_folder.py: an export from a process that never imported DeepSpeed does not import it
(accelerate's unwrap in save_pretrained would, for an isinstance test: about 0.35 s of CPU per export), and the
folder is the same as where DeepSpeed is imported (a ZeRO run), where accelerate's own check is left alone."""
from __future__ import annotations

import sys

import accelerate.utils.other as accelerate_other
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models.tokenizer import embedded_tokenizer
from trainer.exporting.hf_folder import write_hf_folder


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
