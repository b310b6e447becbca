"""The embedded tokenizer, the model presets' sizes, seeded builds, and model-loading errors."""
from __future__ import annotations

import pytest
import torch

from models import registry
from models.tokenizer import EOS_TOKEN, PAD_TOKEN, embedded_tokenizer
from trainer.config.schema import ModelConfig
from tessera.errors import ModelError

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Unicode: caf\u00e9, na\u00efve, \u00fcber, \u65e5\u672c\u8a9e, emoji \U0001F600, math \u2211\u221e",
    "  leading spaces, tabs\tand\nnewlines\r\n",
    "",
]


@pytest.fixture(scope="module")
def tok():
    return embedded_tokenizer()


def test_embedded_tokenizer_special_tokens(tok):
    assert len(tok) == 258
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == 256
    assert tok.bos_token_id == 256
    assert tok.pad_token == PAD_TOKEN and tok.pad_token_id == 257


@pytest.mark.parametrize("text", TEXTS)
def test_embedded_tokenizer_is_byte_level_and_round_trips(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # one id per UTF-8 byte
    assert tok.decode(ids) == text


def test_embedded_tokenizer_special_token_in_text(tok):
    ids = tok("ab" + EOS_TOKEN + "c", add_special_tokens=False)["input_ids"]
    assert ids == [97, 98, 256, 99]
    assert tok.decode(ids) == "ab" + EOS_TOKEN + "c"
    assert tok.decode(ids, skip_special_tokens=True) == "abc"


def test_embedded_tokenizer_save_and_reload(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(again) == len(tok)
    assert (again.eos_token_id, again.bos_token_id, again.pad_token_id) == (256, 256, 257)
    for text in TEXTS + ["x" + EOS_TOKEN + PAD_TOKEN]:
        assert again(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
        assert again.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def _preset(name: str, compose_fn):
    cfg = compose_fn([f"model={name}"])
    tokenizer = registry.load_tokenizer(cfg.model)
    return cfg.model, registry.describe(cfg.model, tokenizer)


def _meta_param_count(info) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: no memory, no init time
        model = AutoModelForCausalLM.from_config(info.hf_config)
    return registry.count_parameters(model)


@pytest.mark.parametrize("name,kind,low,high", [
    ("tiny", "llama", 3.0e6, 3.2e6),
    ("llama_10m", "llama", 10.0e6, 11.0e6),
    ("gpt2_10m", "gpt2", 10.5e6, 11.5e6),
    ("llama_100m", "llama", 95e6, 105e6),
    ("gpt2_100m", "gpt2", 95e6, 105e6),
])
def test_preset_parameter_counts(compose, name, kind, low, high):
    m, info = _preset(name, compose)
    assert m.kind == kind
    n = _meta_param_count(info)
    assert low <= n <= high, f"{name}: {n / 1e6:.2f}M parameters"
    assert info.vocab_size == 264 and info.vocab_size % registry.VOCAB_MULTIPLE == 0


def test_tiny_preset_exact_shape(compose):
    m, info = _preset("tiny", compose)
    c = info.hf_config
    assert (info.hidden_size, info.num_layers, info.num_heads, info.num_kv_heads, info.max_positions) == \
        (256, 4, 8, 4, 1024)
    assert (c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (704, 264, False)
    # 4 layers x (attention 2*256*256 + 2*256*128, MLP 3*256*704, 2 norms) + 2 embedding tables + final norm
    per_layer = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 704 + 2 * 256
    assert _meta_param_count(info) == 4 * per_layer + 2 * 264 * 256 + 256 == 3_086_592


def test_default_intermediate_size_rounds_to_64():
    m = ModelConfig(kind="llama", hidden_size=96, num_layers=1, num_heads=4, intermediate_size=None)
    info = registry.describe(m, embedded_tokenizer())
    assert info.hf_config.intermediate_size == 256  # 8/3 * 96 = 256 exactly
    m = ModelConfig(kind="llama", hidden_size=112, num_layers=1, num_heads=4, intermediate_size=None)
    assert registry.describe(m, embedded_tokenizer()).hf_config.intermediate_size == 320  # 298 -> 320


SMALL = ModelConfig(kind="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                    max_position_embeddings=64)


@pytest.fixture(scope="module")
def small_info(tok):
    return registry.describe(SMALL, tok)


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_build_is_deterministic_from_the_seed(small_info):
    a = registry.build(SMALL, small_info, seed=123)
    b = registry.build(SMALL, small_info, seed=123)
    assert _same_weights(a, b)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in a.parameters())
    c = registry.build(SMALL, small_info, seed=124)
    sa, sc = a.state_dict(), c.state_dict()
    differing = [k for k in sa if not torch.equal(sa[k], sc[k])]
    # every randomly initialized matrix differs (norm gains are all ones whatever the seed)
    assert len(differing) == sum(1 for v in sa.values() if v.dim() >= 2)


def test_build_does_not_touch_the_global_rng(small_info):
    torch.manual_seed(99)
    expected = torch.rand(5)
    torch.manual_seed(99)
    registry.build(SMALL, small_info, seed=7)
    assert torch.equal(torch.rand(5), expected)


def test_build_ignores_the_global_rng_state(small_info):
    torch.manual_seed(1)
    a = registry.build(SMALL, small_info, seed=5)
    torch.manual_seed(2)
    torch.rand(100)
    b = registry.build(SMALL, small_info, seed=5)
    assert _same_weights(a, b)


def test_gpt2_preset_builds_and_runs(tok):
    m = ModelConfig(kind="gpt2", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=None,
                    max_position_embeddings=16)
    info = registry.describe(m, tok)
    model = registry.build(m, info, seed=0)
    out = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 264)


def test_gpt2_rejects_grouped_query_attention(tok):
    m = ModelConfig(kind="gpt2", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
    with pytest.raises(ModelError, match="num_kv_heads"):
        registry.describe(m, tok)


def test_unknown_kind_is_a_model_error(tok):
    with pytest.raises(ModelError, match="model.kind='mamba' is unknown"):
        registry.describe(ModelConfig(kind="mamba"), tok)


def test_hf_missing_folder_is_a_model_error(tmp_path):
    missing = str(tmp_path / "no-model-here")
    m = ModelConfig(kind="hf", name_or_path=missing, tokenizer=None)
    with pytest.raises(ModelError, match="no such folder") as info:
        registry.load_tokenizer(m)
    assert missing in str(info.value) and "model.name_or_path" in str(info.value)
    with pytest.raises(ModelError, match="no such folder"):
        registry.describe(m, embedded_tokenizer())


def test_model_problems_seq_len_and_vocab(compose):
    cfg = compose(["data.seq_len=4096"])
    tokenizer = registry.load_tokenizer(cfg.model)
    info = registry.describe(cfg.model, tokenizer)
    problems = registry.model_problems(cfg, info, tokenizer)
    assert problems == ["data.seq_len=4096 exceeds model.max_position_embeddings=1024; lower data.seq_len"]


def test_real_hf_model_loads(shared_data):
    folder = str(shared_data / "models" / "stories260K-hf")
    m = ModelConfig(kind="hf", name_or_path=folder, tokenizer=None)
    tokenizer = registry.load_tokenizer(m)
    assert len(tokenizer) == 512 and tokenizer.eos_token == "</s>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id  # no pad token of its own: EOS stands in
    info = registry.describe(m, tokenizer)
    assert (info.hidden_size, info.num_layers, info.num_heads, info.num_kv_heads, info.vocab_size,
            info.max_positions) == (64, 5, 8, 4, 512, 512)
    model = registry.build(m, info, seed=0)
    assert registry.count_parameters(model) == 292_800
    ids = tokenizer("Once upon a time", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Lily" in tokenizer.decode(out[0, ids.shape[1]:])


# ---- attention implementation: the model's own choice unless set; one config problem when it can't run ----
def _check_problems(compose_fn, overrides) -> list:
    from trainer.run import build as B
    from tessera.errors import ConfigError

    cfg = compose_fn(list(overrides) + ["strategy=single"])
    try:
        B.check(cfg, 1)
    except ConfigError as e:
        return e.problems
    return []


@pytest.fixture(scope="module")
def gemma2_folder(tmp_path_factory):
    from tests.archs import make_model_folder

    return make_model_folder("gemma2", tmp_path_factory.mktemp("gemma2"))


def attention_implementation(hf_config) -> str:
    """The attention kernel a built model settled on: transformers has no public getter, the test reads its
    private property (product code never does)."""
    return hf_config._attn_implementation


def test_attn_implementation_defaults_to_what_the_model_supports(compose, gemma2_folder):
    cfg = compose(["model=hf", f"model.name_or_path={gemma2_folder}"])
    assert cfg.model.attn_implementation is None
    tokenizer = registry.load_tokenizer(cfg.model)
    model = registry.build(cfg.model, registry.describe(cfg.model, tokenizer))
    # Gemma-2 softcaps its attention logits, which SDPA can't: transformers' default for it is eager.
    assert attention_implementation(model.config) == "eager"
    out = model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]]))
    assert torch.isfinite(out.loss)

    preset = compose(["model=tiny", "model.num_layers=1"]).model
    llama = registry.build(preset, registry.describe(preset, embedded_tokenizer()), seed=0)
    assert attention_implementation(llama.config) == "sdpa"  # where the model supports it, SDPA


def test_explicit_attn_implementation_is_kept(compose, gemma2_folder):
    m = compose(["model=tiny", "model.num_layers=1", "model.attn_implementation=eager"]).model
    model = registry.build(m, registry.describe(m, embedded_tokenizer()), seed=0)
    assert attention_implementation(model.config) == "eager"
    assert _check_problems(compose, ["model=hf", f"model.name_or_path={gemma2_folder}",
                                     "model.attn_implementation=eager"]) == []


@pytest.mark.parametrize("overrides,words", [
    (["model=hf", "model.attn_implementation=sdpa"], ["model.attn_implementation=sdpa", "Gemma2ForCausalLM"]),
    (["model.attn_implementation=flash_attention_2", "train.device=cpu"],
     ["model.attn_implementation=flash_attention_2", "CUDA"]),
    (["model.attn_implementation=no_such_kernel"], ["model.attn_implementation=no_such_kernel", "not supported"]),
], ids=["sdpa-on-gemma2", "flash-on-cpu", "unknown"])
def test_attn_implementation_the_model_or_machine_cant_run_is_one_config_problem(compose, gemma2_folder,
                                                                                 overrides, words):
    if "model=hf" in overrides:
        overrides = overrides + [f"model.name_or_path={gemma2_folder}"]
    problems = _check_problems(compose, overrides)
    assert len(problems) == 1, problems
    assert all(w in problems[0] for w in words), problems[0]


# ---- only causal decoders: encoders and encoder-decoders are refused before any process group starts --------
def _save_config_folder(config, path):
    config.save_pretrained(path)
    embedded_tokenizer().save_pretrained(path)
    return path


def test_bert_encoder_is_refused(compose, tmp_path):
    from transformers import AutoModelForMaskedLM, BertConfig

    config = BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)
    AutoModelForMaskedLM.from_config(config).save_pretrained(tmp_path)  # a real (tiny) BERT checkpoint
    embedded_tokenizer().save_pretrained(tmp_path)
    m = ModelConfig(kind="hf", name_or_path=str(tmp_path), tokenizer=None)
    with pytest.raises(ModelError) as e:
        registry.describe(m, registry.load_tokenizer(m))
    assert str(e.value).startswith(f"model.name_or_path: {tmp_path} holds a bert model, which is not a causal decoder")
    problems = _check_problems(compose, ["model=hf", f"model.name_or_path={tmp_path}"])
    assert len(problems) == 1 and "not a causal decoder" in problems[0], problems


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_encoder_decoder_is_refused(compose, tmp_path, arch):
    from transformers import BartConfig, T5Config

    config = (T5Config(vocab_size=320, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2) if arch == "t5" else
              BartConfig(vocab_size=320, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                         decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64))
    _save_config_folder(config, tmp_path)
    problems = _check_problems(compose, ["model=hf", f"model.name_or_path={tmp_path}"])
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"model.name_or_path: {tmp_path} holds a {arch} model, which is not a causal "
                                  f"decoder (but an encoder-decoder)"), problems[0]


def test_bert_configured_as_a_decoder_is_accepted(tmp_path):
    from transformers import BertConfig

    config = BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, is_decoder=True)
    _save_config_folder(config, tmp_path)
    m = ModelConfig(kind="hf", name_or_path=str(tmp_path), tokenizer=None)
    assert registry.describe(m, registry.load_tokenizer(m)).num_layers == 1


# ---- the source's generation config, whichever way the model is built ----------------------------------------
SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 33}


def _folder_with_generation_config(path, body: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(exist_ok=True)
    tok = embedded_tokenizer()
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(body)
    return ModelConfig(kind="hf", name_or_path=str(path), tokenizer=None)


def test_a_model_built_without_its_weights_keeps_the_sources_generation_config(tmp_path):
    """The sharded strategies build a pretrained model from its config (load_weights=False) and read the weights
    themselves; the model still carries the folder's generation_config.json (sampling defaults, stop tokens) as
    from_pretrained's does, so every layout exports it. Before, such a model had the one derived from config.json."""
    import json

    m = _folder_with_generation_config(tmp_path, json.dumps({**SAMPLING, "eos_token_id": [1, 7]}))
    info = registry.describe(m, registry.load_tokenizer(m))
    loaded = registry.build(m, info)
    with torch.device("meta"):
        built = registry.build(m, info, load_weights=False)
    for model in (loaded, built):
        got = model.generation_config.to_dict()
        assert {k: got[k] for k in SAMPLING} == SAMPLING and got["eos_token_id"] == [1, 7], got
    assert built.generation_config.to_diff_dict() == loaded.generation_config.to_diff_dict()


def test_without_the_file_or_with_an_invalid_one_built_and_loaded_models_agree(tmp_path):
    """No generation_config.json (or one that is not JSON): both ways give the one derived from config.json, as
    from_pretrained falls back; values transformers refuses: one model error naming the folder."""
    import json

    for name, body in (("none", None), ("not-json", "{not json")):
        m = _folder_with_generation_config(tmp_path / name, body or "")
        if body is None:
            (tmp_path / name / "generation_config.json").unlink()
        info = registry.describe(m, registry.load_tokenizer(m))
        with torch.device("meta"):
            built = registry.build(m, info, load_weights=False)
        assert built.generation_config.to_diff_dict() == registry.build(m, info).generation_config.to_diff_dict()
        assert built.generation_config.eos_token_id == info.hf_config.eos_token_id
    m = _folder_with_generation_config(tmp_path / "refused", json.dumps({"max_new_tokens": -3}))
    info = registry.describe(m, registry.load_tokenizer(m))
    with torch.device("meta"), pytest.raises(ModelError, match="cannot load the generation config") as e:
        registry.build(m, info, load_weights=False)
    assert "model.name_or_path" in str(e.value) and "max_new_tokens" in str(e.value), e.value
