"""Shared test fixtures: repository paths, the shared real data, generated stand-ins for it, and an isolated
tokenization cache.

Every test that reads ../shared/data has a generated equivalent that always runs: `generated_data` builds a tiny
Llama (LlamaConfig + save_pretrained, with the embedded tokenizer), a text corpus, alpaca-style and chat SFT
records and DeepSpeed JSON files shaped like the users' ("auto" values). Tests that take the `data_source`
fixture run on both: [generated] always, [real] only where the shared folder exists (it skips otherwise).
TESSERA_SHARED_DATA overrides the shared folder's location; `TESSERA_SHARED_DATA=/nonexistent pytest` shows
what runs without it (only the [real] extras skip)."""
from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import pytest

from tests import warm

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("TESSERA_SHARED_DATA") or REPO.parent / "shared" / "data")
CONF_DIR = REPO / "conf"

# `trainer` and `models` are imported from the checkout (the project is not installed into the venv).
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Tests never reach the Hugging Face hub: a hub lookup fails at once instead of retrying for half a minute.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One intra-op thread in every test process and every process a test starts: the pytest workers and the ranks
# they launch already fill the cores, and OpenMP threads that wait for a busy core spin (measured on 2 loaded
# cores: a 10-step run used 40 s of CPU with 2 threads, 14 s with 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def shared_path(*parts: str) -> Path:
    """A path under ../shared/data (it may not exist; use the `shared_data` fixture to skip when absent)."""
    return SHARED.joinpath(*parts)


def require_shared_data() -> Path:
    """SHARED, or skip the calling test with the reason when the folder is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"real-file extra: {SHARED} does not exist (the real models and datasets live in ../shared/data "
                    f"or $TESSERA_SHARED_DATA; the [generated] variant of this test runs without them)")
    return SHARED


def compose_config(overrides=(), typed: bool = True):
    """Compose the real conf/ with Hydra (trainer.config.compose, as the commands do) -> TesseraConfig, or the raw
    DictConfig with typed=False. Composition errors (unknown keys, wrong types) propagate."""
    from trainer.config.compose import compose
    from trainer.config.schema import to_object

    cfg = compose(list(overrides))
    return to_object(cfg) if typed else cfg


@pytest.fixture
def compose():
    """`compose(["model=gpt2_10m", ...])` -> TesseraConfig composed from the real conf/."""
    return compose_config


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared real-data folder (models/, datasets/, tokenizers/); skips the test when it is absent.
    Session-scoped, so module- and session-scoped fixtures can build on it."""
    return require_shared_data()


# ---- the data the tests train on: generated (always) and real (../shared/data, an extra) ---------------------
@dataclass(frozen=True)
class DataSource:
    """A model folder, a text corpus, SFT records and users' DeepSpeed JSON files, generated or real."""
    name: str  # "generated" or "real"
    model: Path  # a Llama folder (config.json, safetensors, tokenizer)
    text: Path  # plain text for data=text
    alpaca: Path  # alpaca-style {instruction, input, output} records (JSON list)
    chat: Optional[Path]  # chat {messages: [{role, content}]} records, where the source has them
    deepspeed: Dict[str, Path]  # users' DeepSpeed JSON files ("auto" values) by the strategy that reads them
    num_params: int  # parameters of the model


def _real_source(root: Path) -> DataSource:
    ds = root / "deepspeed"
    return DataSource("real", root / "models" / "stories260K-hf", root / "datasets" / "tinyshakespeare.txt",
                      root / "datasets" / "alpaca_en_demo.json", None,
                      {"zero2": ds / "ds_config_zero2.json", "zero3": ds / "ds_config_zero3.json",
                       "zero3-bf16-auto": ds / "ds_z3_config.json"}, 292_800)


# Shaped like stories260K (8 heads, 4 KV heads, intermediate 172, vocabulary 512: every tensor-parallel split of
# the real model is exercised) with 2 decoder blocks instead of 5.
GENERATED_LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, attention_dropout=0.0)

_NAMES = ["ROMEO", "JULIET", "NURSE", "MERCUTIO", "FRIAR", "CAPULET", "TYBALT", "BENVOLIO"]
_WORDS = ("the a my thy his her our what light soft love night day sword heart death life fair sweet gentle "
          "speak hear look come go stay fly break kill kiss yet but and if so not now then here there within "
          "window moon sun star eyes hand lips name rose house blood peace fortune grave morning").split()


def _sentence(rng) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 11))]
    return " ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ";"])


def generated_corpus(n_lines: int = 2400, seed: int = 0) -> str:
    """A deterministic play-like text (about 150 KB): speaker lines of random words, blank lines between."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n_lines // 3):
        out.append(f"{rng.choice(_NAMES)}:")
        out += [" ".join(_sentence(rng) for _ in range(rng.randint(1, 3))) for _ in range(2)]
        out.append("")
    return "\n".join(out)


def generated_sft_records(n: int = 48, seed: int = 0):
    """(alpaca-style records, chat records): short instructions and answers of random words."""
    import random

    rng = random.Random(seed)
    alpaca, chat = [], []
    for i in range(n):
        instruction = f"Answer as {rng.choice(_NAMES).title()}: {_sentence(rng)}"
        extra = _sentence(rng) if i % 3 == 0 else ""
        answer = " ".join(_sentence(rng) for _ in range(rng.randint(2, 4)))
        alpaca.append({"instruction": instruction, "input": extra, "output": answer})
        turns = [{"role": "user", "content": instruction}, {"role": "assistant", "content": answer}]
        if i % 2:
            turns += [{"role": "user", "content": _sentence(rng)}, {"role": "assistant", "content": _sentence(rng)}]
        chat.append({"messages": turns})
    return alpaca, chat


def generated_deepspeed_configs() -> Dict[str, dict]:
    """DeepSpeed JSON files as users bring them (HF Trainer style): "auto" for everything Tessera derives, an
    optimizer and scheduler section (Tessera's own run instead), explicit ZeRO knobs that must be kept."""
    common = {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                       "hysteresis": 2, "min_loss_scale": 1},
              "bf16": {"enabled": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto"}},
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
              "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
    zero2 = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}, "allgather_partitions": True,
             "allgather_bucket_size": 2e8, "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 2e8,
             "contiguous_gradients": True}
    zero3 = {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9,
             "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
             "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
             "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}
    return {"zero2": dict(common, zero_optimization=zero2), "zero3": dict(common, zero_optimization=zero3)}


def make_generated_data(root: Path) -> DataSource:
    """Write the generated model, corpus, SFT records and DeepSpeed JSON files under `root`."""
    import json

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from models.tokenizer import embedded_tokenizer

    tok = embedded_tokenizer()
    model_dir = root / "models" / "tiny-llama-hf"
    config = LlamaConfig(**GENERATED_LLAMA, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    assert len(tok) <= config.vocab_size
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(1)
        model = LlamaForCausalLM(config).float()
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(model_dir)
    # a generation config of the model's own, as hub models ship (sampling defaults, a second stop token): every
    # layout's export and the export command must carry it (tests/integration/conftest.py check_generation_config)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, tok.pad_token_id],
                     pad_token_id=tok.pad_token_id, do_sample=True, temperature=0.6, top_p=0.9,
                     max_new_tokens=48).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    num_params = sum(p.numel() for p in model.parameters())

    datasets = root / "datasets"
    datasets.mkdir(parents=True)
    (datasets / "corpus.txt").write_text(generated_corpus())
    alpaca, chat = generated_sft_records()
    (datasets / "alpaca.json").write_text(json.dumps(alpaca, indent=1))
    (datasets / "chat.json").write_text(json.dumps(chat, indent=1))
    ds_dir = root / "deepspeed"
    ds_dir.mkdir()
    ds = {}
    for name, body in generated_deepspeed_configs().items():
        ds[name] = ds_dir / f"ds_{name}.json"
        ds[name].write_text(json.dumps(body, indent=4))
    return DataSource("generated", model_dir, datasets / "corpus.txt", datasets / "alpaca.json",
                      datasets / "chat.json", ds, num_params)


@pytest.fixture(scope="session")
def generated_data(tmp_path_factory) -> DataSource:
    """The generated stand-in for ../shared/data (made once per session; no files outside the test's tmp)."""
    return make_generated_data(tmp_path_factory.mktemp("generated-data"))


@pytest.fixture(scope="session", params=["generated", "real"])
def data_source(request) -> DataSource:
    """Both data sources: [generated] always runs; [real] is the extra on ../shared/data and skips without it."""
    if request.param == "generated":
        return request.getfixturevalue("generated_data")
    return _real_source(require_shared_data())


@pytest.fixture(scope="session", autouse=True)
def tessera_cache_dir(tmp_path_factory) -> Path:
    """Point TESSERA_CACHE at a fresh folder for the test session, so that the tokenization cache never
    touches ~/.cache/tessera (nor does the `datasets` Arrow cache). Child processes started by tests inherit
    it. Tests that count cache entries should still set data.cache_dir to their own tmp_path."""
    path = tmp_path_factory.mktemp("tessera-cache")
    with _environ(TESSERA_CACHE=str(path), HF_DATASETS_CACHE=str(path / "hf-datasets")):
        _point_datasets_cache_at(path / "hf-datasets")  # `datasets` reads its cache path when imported
        yield path


@contextmanager
def _environ(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _point_datasets_cache_at(path: Path) -> None:
    """`datasets` reads HF_DATASETS_CACHE when first imported; if that already happened, repoint it too, so
    that `load_dataset` on local JSON / text files writes its Arrow files under `path`."""
    module = sys.modules.get("datasets.config")
    if module is not None:
        module.HF_DATASETS_CACHE = path


def pytest_configure(config):
    """One catalogue file for the session, shared by pytest-xdist's workers (they inherit the environment)."""
    if not hasattr(config, "workerinput") and "TESSERA_CATALOGUE_ROWS" not in os.environ:
        import tempfile

        fd, path = tempfile.mkstemp(prefix="tessera-catalogue-", suffix=".jsonl")
        os.close(fd)
        os.environ["TESSERA_CATALOGUE_ROWS"] = path
        config._tessera_catalogue = path


def pytest_unconfigure(config):
    path = getattr(config, "_tessera_catalogue", None)
    if path:
        os.environ.pop("TESSERA_CATALOGUE_ROWS", None)
        try:
            os.remove(path)
        except OSError:
            pass


def pytest_terminal_summary(terminalreporter):
    """The catalogue of bad input and faults (tests/integration/catalogue.py), when any case ran."""
    from tests.integration import catalogue

    if hasattr(terminalreporter.config, "workerinput"):
        return
    rows = catalogue.all_rows()
    if not rows:
        return
    text = catalogue.table(rows)
    terminalreporter.write_sep("-", f"catalogue of bad input and faults ({len(rows)} cases)")
    terminalreporter.write_line(text)
    out = os.environ.get("TESSERA_CATALOGUE_OUT")
    if out:
        Path(out).write_text(text + "\n")


def pytest_collection_finish(session):
    """The test modules' imports (torch, transformers, DeepSpeed) frozen out of the cyclic collector's walks, as
    trainer/main.py does for a run (tessera/import_time.py): every later collection in this worker walks only
    what the tests allocate."""
    gc.freeze()


def _cpu_seconds() -> float:
    """User + system CPU of this worker and of every process it started and waited for (ranks included)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """TESSERA_TEST_CPU_OUT=<file>: one JSON line per test with its wall and CPU seconds (set-up, call and
    teardown; the processes it launched included, warm-started ones too). The suite's two cores are its limit, so CPU, not wall, says
    which tests make it long (docs/testing.md). A child counts when it is reaped: one an earlier test left running
    and that is reaped now counts here."""
    out = os.environ.get("TESSERA_TEST_CPU_OUT")
    if not out:
        yield
        return
    wall, cpu = time.monotonic(), _cpu_seconds()
    yield
    record = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2),
              "cpu_s": round(_cpu_seconds() - cpu + warm.cpu_seconds(item.nodeid), 2)}
    with open(out, "a") as fh:
        fh.write(json.dumps(record) + "\n")
