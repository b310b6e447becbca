"""The experiment bundles (conf/experiment/*.yaml, every file found by glob, so a new bundle is covered at once).

A bundle is written as a user would write it: a hub model id and a hub dataset name (or a data.path left to the
user as `???`), never a path that exists only beside this repository. The tests hold each bundle to that, run it
for two steps with local overrides (the real files in ../shared/data where present, else the generated tiny Llama
and data of tests/conftest.py: nothing here skips without ../shared), and check what a user without hub access
sees: one message naming the hub id and the local override, exit code 2."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import SHARED, DataSource, _real_source, compose_config
from tests.integration.conftest import REPO, read_jsonl

BUNDLES = sorted((REPO / "conf" / "experiment").glob("*.yaml"))
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as on the hub

# Two steps on one process, nothing written after them: the bundle's own model, data and seq_len are kept.
QUICK = ["strategy=single", "train.device=cpu", "train.max_steps=2", "train.global_batch_size=4",
         "train.micro_batch_size=2", "train.log_every=1", "eval.every=0", "eval.at_start=false", "eval.at_end=false",
         "checkpoint.every=0", "checkpoint.at_end=false", "export.hf_at_end=false", "logging.progress=false",
         "data.max_records=200"]


def _one_bundle_per_model_id():
    """The first bundle naming each hub model id (the message without hub access depends on the id alone: one
    entry-point run per id keeps the test short)."""
    firsts = {}
    for bundle in BUNDLES:
        name = (OmegaConf.load(bundle).get("model") or {}).get("name_or_path")
        if name:
            firsts.setdefault(name, bundle)
    return sorted(firsts.values())


def test_bundles_are_found():
    assert BUNDLES, "conf/experiment/ holds no bundles"


def _raw(bundle: Path):
    """The bundle composed by Hydra, untyped and unresolved (a `???` path stays visible as missing)."""
    return compose_config([f"experiment={bundle.stem}"], typed=False)


def _strings(node, key=""):
    """(key, value) of every string in the config (`???` and interpolations as written)."""
    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=False)
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
    if items is None:
        if isinstance(node, str):
            yield key, node
        return
    for k, v in items:
        yield from _strings(v, f"{key}.{k}" if key else str(k))


def _local_override(node, key: str) -> bool:
    return key in node and not OmegaConf.is_missing(node, key) and node[key] is not None


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda p: p.stem)
def test_bundle_names_hub_ids_not_local_paths(bundle):
    """A hub model id and a hub dataset name (or a path the user must give): it runs anywhere with hub access."""
    text = bundle.read_text()
    assert f"./launch.sh experiment={bundle.stem}" in text, \
        f"{bundle.name}: the header comment shows the command that runs it"
    assert "model.name_or_path=" in text, f"{bundle.name}: the header comment shows the local-file override form"
    cfg = _raw(bundle)
    for key, value in _strings(cfg):
        assert "shared/data" not in value and not value.startswith(("../", "./")), \
            f"{bundle.name}: {key}={value!r} is a path beside this repository; name a hub id instead"
    if cfg.model.kind == "hf":
        name = cfg.model.name_or_path
        assert HUB_ID.fullmatch(name or "") and not (REPO / name).exists(), \
            f"{bundle.name}: model.name_or_path={name!r} is not a hub id (owner/name)"
    data = cfg.data
    if data.kind == "hub" or (data.kind == "sft" and not _local_override(data, "path")):
        if data.kind == "sft" and OmegaConf.is_missing(data, "path"):
            return  # the user gives the records: `data.path: ???` (a clear message when missing)
        assert HUB_ID.fullmatch(data.name or ""), f"{bundle.name}: data.name={data.name!r} is not a hub dataset id"
    elif data.kind == "text":
        assert OmegaConf.is_missing(data, "path"), \
            f"{bundle.name}: data=text reads local files: leave data.path to the user (`???`) or use a hub dataset"
    else:
        pytest.fail(f"{bundle.name}: data.kind={data.kind}: teach this test where its local data comes from")


@pytest.fixture(scope="module")
def local_files(request) -> DataSource:
    """The real files of ../shared/data where that folder exists, else the generated tiny Llama, text and records."""
    if SHARED.is_dir():
        return _real_source(SHARED)
    return request.getfixturevalue("generated_data")


def local_overrides(bundle: Path, files: DataSource) -> list:
    """The overrides that run `bundle` on local files: the model folder, and the data as a local copy."""
    cfg = _raw(bundle)
    out = [f"experiment={bundle.stem}"]
    if cfg.model.kind == "hf":
        out.append(f"model.name_or_path={files.model}")
    kind = cfg.data.kind
    if kind == "hub":
        out += ["data=text", f"data.path={files.text}"]
    elif kind == "sft":
        out.append(f"data.path={files.alpaca}")
    elif kind == "text":
        out.append(f"data.path={files.text}")
    else:
        pytest.fail(f"{bundle.name}: data.kind={kind}: teach this test where its local data comes from")
    return out


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda p: p.stem)
def test_bundle_trains_on_local_files(bundle, local_files, tmp_path):
    """The bundle, with its hub ids swapped for local files, composes, passes every check and trains two steps."""
    from trainer.run import build as B
    from trainer.run.loop import fit

    overrides = local_overrides(bundle, local_files) + QUICK
    cfg = compose_config(overrides)
    run = B.build(B.prepare(cfg, str(tmp_path)))
    try:
        fit(run)
    finally:
        B.close(run)
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    print(f"{bundle.stem} ({local_files.name} files): losses {[round(r['loss'], 4) for r in recs]}")
    assert [r["step"] for r in recs] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["tokens"] > 0 for r in recs), recs


def _no_hub_env(tmp_path) -> dict:
    """No hub: offline mode and an empty hub cache (a cached copy would let the bundle start training)."""
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"),
                HF_DATASETS_CACHE=str(tmp_path / "hf-datasets"), TESSERA_CACHE=str(tmp_path / "cache"),
                PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


@pytest.mark.parametrize("bundle", _one_bundle_per_model_id(), ids=lambda p: p.stem)
def test_bundle_without_hub_access_says_what_to_do(bundle, tmp_path):
    """`./launch.sh experiment=<bundle>` where the hub cannot be reached: one message naming the model id and the
    local override, exit code 2, no traceback."""
    cfg = _raw(bundle)
    proc = subprocess.run([sys.executable, str(REPO / "trainer" / "main.py"), f"experiment={bundle.stem}",
                           "strategy=single", f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO,
                          env=_no_hub_env(tmp_path), capture_output=True, text=True, timeout=180)
    err = proc.stderr.strip()
    print(f"{bundle.stem}: exit {proc.returncode}\n{err}")
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err
    assert f"model.name_or_path: {cfg.model.name_or_path!r} is not a local folder" in err, err
    assert "without hub access, give a local folder instead" in err, err


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda p: p.stem)
def test_bundle_dataset_without_hub_access_names_the_local_override(bundle, local_files, tmp_path):
    """The model found locally, the hub dataset not reachable: one DataError naming data.name and the override."""
    from tessera.errors import DataError
    from trainer.run import build as B
    from trainer.resilience import rundir

    cfg = _raw(bundle)
    if cfg.data.kind not in ("hub", "sft") or not _local_override(cfg.data, "name") or \
            _local_override(cfg.data, "path") or OmegaConf.is_missing(cfg.data, "path"):
        pytest.skip(f"{bundle.name} reads no hub dataset")
    overrides = [f"experiment={bundle.stem}", f"model.name_or_path={local_files.model}",
                 f"data.cache_dir={tmp_path / 'cache'}"] + QUICK
    local = "data=text data.path=" if cfg.data.kind == "hub" else "data.path="
    try:
        with pytest.raises(DataError) as info:
            B.prepare(compose_config(overrides), str(tmp_path / "run"))
    finally:
        rundir.release(str(tmp_path / "run"))
    message = str(info.value)
    print(f"{bundle.stem}: {message}")
    assert f"data.name={cfg.data.name!r}: cannot load the hub dataset" in message, message
    assert f"without hub access, train on a local copy with {local}" in message, message
    assert "\n" not in message
