"""Shared test fixtures: repository paths, the shared real data, and an isolated tokenization cache."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "data"
CONF_DIR = REPO / "conf"

# `trainer` and `models` are imported from the checkout (the project is not installed into the venv).
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Tests never reach the Hugging Face hub: a hub lookup fails at once instead of retrying for half a minute.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def shared_path(*parts: str) -> Path:
    """A path under ../shared/data (it may not exist; use the `shared_data` fixture to skip when absent)."""
    return SHARED.joinpath(*parts)


def require_shared_data() -> Path:
    """SHARED, or skip the calling test with the reason when the folder is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"../shared/data is absent: {SHARED} does not exist (tests on real models and datasets "
                    f"need it next to the repository; see its README.md)")
    return SHARED


def compose_config(overrides=(), typed: bool = True):
    """Compose the real conf/ with Hydra (as trainer/main.py does) -> TesseraConfig, or the raw DictConfig
    with typed=False. Composition errors (unknown keys, wrong types) propagate."""
    from hydra import compose, initialize_config_dir

    from trainer.cli import register_resolvers
    from trainer.config import register_configs, to_object

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
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


def pytest_terminal_summary(terminalreporter):
    """The catalogue of bad input and faults (tests/integration/catalogue.py), when any case ran."""
    from tests.integration import catalogue

    if not catalogue.ROWS:
        return
    text = catalogue.table()
    terminalreporter.write_sep("-", f"catalogue of bad input and faults ({len(catalogue.ROWS)} cases)")
    terminalreporter.write_line(text)
    out = os.environ.get("TESSERA_CATALOGUE_OUT")
    if out:
        Path(out).write_text(text + "\n")
