"""Every message a user sees names what failed and what to do: an exception's bare text (a key, a number, nothing)
is never the message. Two checks:

1. The source: every place in trainer/, models/ and tessera/ that turns an exception into text (an `except ... as
   e` block, or a function that takes the exception) must pass it through `tessera.errors.one_line` (or hand it to
   a function that does); a raw `{e}`, `str(e)` or `e.args` in a message fails here, naming the file and line.
2. The behaviour: each translating place is fed KeyError(0), KeyError('model.layers.0.weight'), IndexError(),
   ValueError(''), RuntimeError('3') and OSError(ENOSPC); its message must name the phase, and a bare exception
   by its type with what to do (rerun with TESSERA_DEBUG=1 for the traceback).
"""
from __future__ import annotations

import ast
import contextlib
import errno
import io
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import datasets
import huggingface_hub
import pytest
import transformers
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException

from models import registry, weights
from tessera.errors import DataError, ModelError, TesseraError, one_line
from trainer.checkpoint import manager as ckpt
from trainer.run import cli
from trainer.exporting import from_checkpoint as export
from trainer.observe import metrics
from trainer.resilience import rundir
from trainer.data import sources, store
from trainer.observe import memory
from trainer.observe.memory import FirstStepProbe
from trainer.strategies import deepspeed
from trainer.parallel import replica_groups

REPO = Path(__file__).resolve().parents[3]
SCANNED = ("trainer", "models", "tessera")

# Lines that read an exception's text on purpose (file, the line's code), and why it never reaches the user raw.
ALLOWED = {
    ("tessera/errors.py", "text = (str(e) if text is None else text).strip()"): "the helper itself",
    ("tessera/pickles.py", "text = str(e)"): "refusal: picks the line to show, then passes it through one_line",
    ("tessera/pickles.py", "return str(e).strip()"): "our own ValueError's text, raised by load_tensors",
    ("trainer/launch/torchrun.py", "text = str(e).lower()"): "matched (address in use), never shown",
    ("trainer/parallel/dims.py", "text = str(e)"): "start_problem: matched; shows only the key names torch lists",
    ("trainer/data/store.py", 'return f"meta.json has no {e} entry"'): "a KeyError's text is the entry it names",
}
EXCEPTION_PARAMS = {"e", "exc", "err", "error"}
RAW_CALLS = {"str", "repr", "format"}


# ---------------------------------------------------------------------------------------------------------
# 1. The source.

def _sources():
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text(), str(path))


def _tessera_error_names(trees) -> set:
    """TesseraError and every subclass defined in the scanned code (their text is ours, not an exception's)."""
    names, grew = {"TesseraError"}, True
    classes = [n for _, tree in trees for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    while grew:
        grew = False
        for c in classes:
            bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in c.bases}
            if c.name not in names and bases & names:
                names.add(c.name)
                grew = True
    return names


def _caught(handler: ast.ExceptHandler) -> set:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return {k.attr if isinstance(k, ast.Attribute) else getattr(k, "id", "") for k in kinds}


def _scopes(tree, ours: set):
    """(exception variable, node to search, function name) for each place that holds a foreign exception."""
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler) and node.name and not _caught(node) <= ours:
            yield node.name, node, _function_of(node, parents)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args:
                if arg.arg in EXCEPTION_PARAMS:
                    yield arg.arg, node, node.name


def _function_of(node, parents) -> str:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node.name
    return "<module>"


def _raw_uses(var: str, scope):
    """Lines where `var` becomes text without one_line: inside an f-string, or as str(var) / repr(var) / var.args
    outside a comparison (matching a text is fine), or passed as is to print() or an error's constructor; and
    `var.strerror` in a message without a fallback (`e.strerror or one_line(e)`: an OSError may have none)."""
    parents = {}
    for node in ast.walk(scope):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(scope):
        if not (isinstance(node, ast.Name) and node.id == var):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.attr == "strerror":
            either = parents.get(parent)  # `e.strerror or one_line(e)`
            guarded = isinstance(either, ast.BoolOp) and either.values[-1] is not parent
            if not guarded and _is_raw(parent, parents):
                yield node.lineno
            continue
        if isinstance(node.ctx, ast.Store) or isinstance(parent, ast.Attribute) and parent.attr != "args":
            continue  # e.strerror, e.filename, e.problems, type(e).__name__ ...: not the exception's text
        if _is_raw(node, parents):
            yield node.lineno


def _is_raw(node, parents) -> bool:
    child, raw = node, False
    while child in parents:
        parent = parents[child]
        if isinstance(parent, ast.Compare):
            return False  # `"GLOBAL" in str(e)`: matched, not shown
        if isinstance(parent, ast.Call) and child is not parent.func:
            name = parent.func.attr if isinstance(parent.func, ast.Attribute) else getattr(parent.func, "id", "")
            if name == "one_line" or not raw and name not in RAW_CALLS | {"print"} and not name.endswith(
                    ("Error", "Exception")):
                return False  # the exception handed to a function (one_line, fault_message, refusal, type, ...)
            if raw:
                return True  # its text handed on (problems.append(str(e)))
            raw = True
        if isinstance(parent, (ast.FormattedValue, ast.Assign, ast.Return)) or (
                isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Mod)):
            return True
        if isinstance(parent, (ast.stmt, ast.ExceptHandler)):
            return raw
        child = parent
    return raw


def test_every_translation_site_uses_one_line():
    trees = list(_sources())
    ours = _tessera_error_names(trees)
    places, raw, allowed = set(), set(), set()
    for rel, tree in trees:
        lines = (REPO / rel).read_text().splitlines()
        for var, scope, function in _scopes(tree, ours):
            places.add((rel, scope.lineno))
            for line in _raw_uses(var, scope):
                key = (rel, lines[line - 1].strip())
                if key in ALLOWED:
                    allowed.add(key)
                else:
                    raw.add(f"{rel}:{line} ({function}): `{var}` becomes text without tessera.errors.one_line")
    assert not raw, "\n".join(sorted(raw))
    assert len(places) >= 40, sorted(places)  # the scan reaches the translating places (about 60 today)
    stale = set(ALLOWED) - allowed
    assert not stale, f"ALLOWED names lines that no longer read an exception's text: {stale}"


def test_the_scan_catches_a_raw_message():
    bad = ast.parse("def f():\n    try:\n        g()\n    except ValueError as e:\n"
                    "        raise DataError(f'data.path: cannot read it: {e}') from None\n"
                    "    except OSError as e:\n        problems.append(str(e))\n"
                    "    except KeyError as e:\n        if 'x' in str(e):\n            pass\n"
                    "        raise DataError(f'{one_line(e)} {e.strerror or one_line(e)}')\n"
                    "    except OSError as e:\n        raise DataError(f'cannot read it ({e.strerror})')\n")
    lines = sorted(line for var, scope, _ in _scopes(bad, {"TesseraError", "DataError"})
                   for line in _raw_uses(var, scope))
    assert lines == [5, 7, 13], lines


# ---------------------------------------------------------------------------------------------------------
# 2. The behaviour: each translating place, fed exceptions whose text says nothing by itself.

BARE = [KeyError(0), KeyError("model.layers.0.weight"), IndexError(), ValueError(""), RuntimeError("3"), OSError()]
DISK_FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _raiser(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


class _Strategy:
    def __init__(self, exc):
        self.exc = exc

    def local_state(self):
        return {}

    def save_checkpoint_state(self, *args):
        raise self.exc

    def load_checkpoint_from(self, *args):
        raise self.exc

    def model_state_bytes(self):
        raise self.exc


def _manager(tmp_path, exc):
    m = ckpt.CheckpointManager.__new__(ckpt.CheckpointManager)  # no process group, no run: the save path only
    strategy = _Strategy(exc)
    m.__dict__.update(strategy=strategy, rank_states=[strategy], states={}, root=str(tmp_path / "checkpoints"), rank=0, group=None,
                      pending=None, last_saved_step=None, stats=[], cfg=SimpleNamespace(async_save=False))
    m._write_rank0_files = lambda tmp, step: None
    return m


def _save(exc, tmp_path, monkeypatch):
    _manager(tmp_path, exc).save(4)


def _background_save(exc, tmp_path, monkeypatch):
    m, future = _manager(tmp_path, exc), Future()
    future.set_exception(exc)
    m.pending = (future, str(tmp_path / "checkpoints" / "tmp"), str(tmp_path / "step_4"), 4, 0.0)
    m.wait()


def _load(exc, tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "read_meta", lambda path: {"optim_param_groups": []})
    monkeypatch.setattr(ckpt, "verify_files", lambda path, meta: None)
    _manager(tmp_path, exc).load(str(tmp_path / "step_4"), weights_only=True)


def _metadata(exc, tmp_path, monkeypatch):
    (tmp_path / ".metadata").write_bytes(b"x")
    monkeypatch.setattr(ckpt, "SafeFileSystemReader", lambda path: SimpleNamespace(read_metadata=_raiser(exc)))
    ckpt.verify_files(str(tmp_path), {"_complete": {"files": {}}})


def _local_data(exc, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", _raiser(exc))
    sources.load_local([str(tmp_path / "corpus.txt")])


def _hub_data(exc, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", _raiser(exc))
    sources.load_hub("org/corpus", None, "train", None)


def _model(**fields):
    return SimpleNamespace(**{"revision": None, "trust_remote_code": False, "attn_implementation": None,
                              "kind": "hf", "tokenizer": None, **fields})


def _model_config(exc, tmp_path, monkeypatch):
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", _raiser(exc))
    registry._hf_config(_model(name_or_path=str(tmp_path)), None)


def _tokenizer(exc, tmp_path, monkeypatch):
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", _raiser(exc))
    registry.load_tokenizer(_model(kind="llama", tokenizer=str(tmp_path), name_or_path=None))


def _model_description(exc, tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "get_spec", lambda kind: SimpleNamespace(make_config=_raiser(exc)))
    registry.describe(_model(kind="llama"), None)


def _hub_weights(exc, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raiser(exc))
    weights._local_folder(_model(name_or_path="org/model"))


def _run_errors(exc, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        with cli.user_errors():
            raise exc
    return err.getvalue()


def _metrics_log(exc, tmp_path, monkeypatch):
    metrics._write(SimpleNamespace(write=_raiser(exc)), str(tmp_path / "metrics.jsonl"), {"step": 1})


def _deepspeed_json(exc, tmp_path, monkeypatch):
    monkeypatch.setattr(deepspeed.json, "load", _raiser(exc))
    (tmp_path / "ds.json").write_text("{}")
    deepspeed._read_user_json(str(tmp_path / "ds.json"))


def _export_dtype(exc, tmp_path, monkeypatch):
    (tmp_path / "config.yaml").write_text("export: {dtype: bf16}\n")
    monkeypatch.setattr(OmegaConf, "load", _raiser(exc))
    export.checkpoint_export_dtype(str(tmp_path))


def _move_aside(exc, tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.os, "mkdir", _raiser(exc))
    rundir.move_aside(str(tmp_path))


def _lighthouse(exc, tmp_path, monkeypatch):
    monkeypatch.setattr(replica_groups.socket, "create_connection", _raiser(exc))
    replica_groups.check_lighthouse(SimpleNamespace(lighthouse="http://127.0.0.1:1"), timeout_s=0.1)


def _memory_probe(exc, tmp_path, monkeypatch):
    if hasattr(memory, "state_bytes"):  # the figures are read through trainer/observe/model_states.py
        monkeypatch.setattr(memory, "state_bytes", lambda strategy: strategy.model_state_bytes())
    probe = FirstStepProbe.__new__(FirstStepProbe)
    probe.strategy, probe.errors = _Strategy(exc), []
    probe.snap("optimizer_step")
    return "; ".join(probe.errors)


def _cache_dir(exc, tmp_path, monkeypatch):
    monkeypatch.setattr(store.os, "makedirs", _raiser(exc))
    store.build_or_load(str(tmp_path / "cache"), {}, "text", 10, lambda: iter(()))


SITES = {  # name: (the call, what its message must name: the phase or the key to change)
    "checkpoint-save": (_save, "saving the checkpoint of step 4 failed"),
    "checkpoint-background-save": (_background_save, "the background save of step 4 failed"),
    "checkpoint-load": (_load, "cannot load checkpoint"),
    "checkpoint-metadata": (_metadata, "its .metadata is damaged"),
    "data-local-files": (_local_data, "data.path: cannot read"),
    "data-hub": (_hub_data, "data.name='org/corpus': cannot load the hub dataset"),
    "model-config": (_model_config, "model.name_or_path: cannot load the model config"),
    "model-tokenizer": (_tokenizer, "model.tokenizer: cannot load the tokenizer"),
    "model-description": (_model_description, "the llama config from model.* is invalid"),
    "model-hub-weights": (_hub_weights, "model.name_or_path: 'org/model' is not a local folder"),
    "run-faults": (_run_errors, "the disk is full"),
    "metrics-log": (_metrics_log, "metrics.jsonl failed"),
    "deepspeed-json": (_deepspeed_json, "strategy.deepspeed_config="),
    "export-dtype": (_export_dtype, "config.yaml: cannot read it"),
    "run-dir-move-aside": (_move_aside, "checkpoint.overwrite=true: moving"),
    "torchft-lighthouse": (_lighthouse, "the torchft lighthouse at http://127.0.0.1:1"),
    "memory-probe": (_memory_probe, "optimizer_step"),
    "tokenization-cache": (_cache_dir, "data.cache_dir="),
}


def _message(site, exc, tmp_path, monkeypatch):
    """The site's message for `exc`, or None when it does not translate it (a bug keeps its traceback)."""
    try:
        out = site(exc, tmp_path, monkeypatch)
    except TesseraError as e:
        return str(e)
    except BaseException as e:  # noqa: BLE001
        if e is exc:
            return None  # not translated: user_errors lets it through with its traceback (exit 1)
        raise
    return out


@pytest.mark.parametrize("name", SITES)
def test_each_translating_place_names_the_phase_and_never_bare_text(name, tmp_path, monkeypatch):
    site, phase = SITES[name]
    translated = 0
    for i, exc in enumerate(BARE + [DISK_FULL]):
        exc = type(exc)(*exc.args)  # a fresh one: no traceback or context from another site
        folder = tmp_path / str(i)
        folder.mkdir()
        with monkeypatch.context() as patch:  # undone before the next folder is made
            message = _message(site, exc, folder, patch)
        if message is None:
            continue
        translated += 1
        assert "Traceback" not in message, message
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            assert "No space left on device" in message or "disk is full" in message, message
            assert phase in message, (exc, message)
            continue
        assert phase in message, (exc, message)
        assert f"{type(exc).__name__}" in message and "TESSERA_DEBUG=1" in message, (repr(exc), message)
    assert translated, f"{name}: no exception was translated"


@pytest.mark.parametrize("exc,expected", [
    (KeyError(0), "KeyError: 0 (an internal error; rerun with TESSERA_DEBUG=1 for its traceback and report it)"),
    (KeyError("model.layers.0.weight"), "KeyError: 'model.layers.0.weight' (an internal error;"),
    (IndexError(), "IndexError with no message (an internal error;"),
    (ValueError(""), "ValueError with no message (rerun with TESSERA_DEBUG=1 for its traceback)"),
    (RuntimeError("3"), "RuntimeError: 3 (rerun with TESSERA_DEBUG=1"),
    (RuntimeError("'weight'"), "RuntimeError: 'weight' (rerun"),
    (DISK_FULL, "[Errno 28] No space left on device"),
    (OSError(errno.ENOSPC, "No space left on device", "/runs/x"), "[Errno 28] No space left on device"),
    (ValueError("the file is not valid JSON\nline 2"), "the file is not valid JSON"),
])
def test_one_line(exc, expected):
    assert one_line(exc).startswith(expected), one_line(exc)


def test_one_line_of_a_dcp_failure_is_its_first_rank_failure():
    e = CheckpointException("save failed", {1: (KeyError(0), None), 0: (RuntimeError("disk gone away"), None)})
    assert one_line(e) == "rank 0: disk gone away"
    assert one_line(CheckpointException("x", {2: (KeyError(0), None)})).startswith("rank 2: KeyError: 0 (")


# ---------------------------------------------------------------------------------------------------------
# Who prints an error that every rank meets (docs/errors-and-exit-codes.md; catalogue rows in tests/integration/test_bad_input.py)

@pytest.mark.parametrize("error,same", [
    (DataError("data.path='/x': no such file or folder"), True),
    (ModelError("model.name_or_path: '/x': no such folder"), True),
    (DataError("data.cache_dir='/x' cannot be created", same_on_every_rank=False), False),
])
def test_same_input_errors_are_left_to_rank_0(error, same, monkeypatch, capsys):
    waited = []
    monkeypatch.setattr(cli, "await_rank0", waited.append)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(SystemExit) as info:
            with cli.user_errors():
                raise error
        assert info.value.code == 2
        # rank 0 prints at once; rank 1 first waits for rank 0 to end the job, and prints only if it did not
        assert capsys.readouterr().err == f"[rank {rank}] error: {error}\n"
    assert waited == ([2] if same else [])


def test_await_rank0_is_ended_by_the_launchers_sigterm(tmp_path):
    """The waiting rank ends at the SIGTERM a launcher sends when rank 0 exits (a handler installed earlier, the
    preemption one, would only set a flag): at once, printing nothing, with the error's exit code."""

    code = ("import signal, sys; signal.signal(signal.SIGTERM, lambda *a: None); print('ready', flush=True)\n"
            "from trainer.run.cli import await_rank0; await_rank0(2); print('still here', flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, TESSERA_RANK0_WAIT_S="60"))
    assert proc.stdout.readline() == "ready\n"
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and out == "", (proc.returncode, out)
