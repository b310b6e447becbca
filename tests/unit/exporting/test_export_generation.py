"""trainer/exporting/from_checkpoint.py: the export command writes the generation config the run saved beside its
config in hf_config/; a checkpoint saved before it was kept there gets the one derived from config.json, as a model
built from that config has."""
from __future__ import annotations

from transformers import GenerationConfig, LlamaConfig

from trainer.exporting.from_checkpoint import _generation_config


def test_the_saved_generation_config_or_for_an_older_checkpoint_the_derived_one(tmp_path):
    config = LlamaConfig(bos_token_id=3, eos_token_id=4, pad_token_id=5)
    config.save_pretrained(tmp_path)
    older = _generation_config(str(tmp_path), config)
    assert older.to_diff_dict() == GenerationConfig.from_model_config(config).to_diff_dict()
    assert older.eos_token_id == 4 and not older.do_sample
    GenerationConfig(eos_token_id=[4, 9], do_sample=True, temperature=0.6).save_pretrained(tmp_path)
    saved = _generation_config(str(tmp_path), config)
    assert (saved.eos_token_id, saved.do_sample, saved.temperature) == ([4, 9], True, 0.6)
