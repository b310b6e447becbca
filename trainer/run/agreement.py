"""What every rank of a job must agree on before the first step, checked once the process group is up: one run
directory (the same path on every rank and, across nodes, one shared folder: each node writes a probe the others
must see), the same code (Tessera's sources and the versions of torch, transformers and DeepSpeed) and the same
config. A job whose nodes disagree would train wrongly, or save a checkpoint no node can read whole: it stops with
one message naming the nodes and what differs (exit code 2)."""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import secrets
import shutil
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List

import torch.distributed as dist

from tessera.errors import ConfigError, TesseraError
from trainer.parallel.dims import env_spans_nodes

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("trainer", "models", "tessera")  # the packages whose code every node must run alike
LIBRARIES = ("torch", "transformers", "deepspeed", "peft", "accelerate")
PROBE_DIR = ".node-probes"


def code_fingerprint() -> str:
    """A digest of Tessera's Python sources and the versions of the libraries that compute the numbers."""
    digest = hashlib.sha256()
    for package in SOURCES:
        for path in sorted((REPO / package).rglob("*.py")):
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    for name in LIBRARIES:
        try:
            digest.update(f"{name}=={importlib.metadata.version(name)}\0".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{name}: absent\0".encode())
    return digest.hexdigest()[:16]


def flat_config(cfg) -> Dict[str, str]:
    """key -> value text of the whole typed config, nested sections as dotted keys."""
    out: Dict[str, str] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            out[prefix[:-1]] = repr(value)
    walk("", asdict(cfg))
    return out


def _view(run_dir: str, cfg, nodes: bool) -> dict:
    """What this rank tells the others; the code and the config only in a job of several nodes (one node's ranks
    come from one launch: one checkout, one command line)."""
    view = {"host": socket.gethostname(), "rank": dist.get_rank(), "run_dir": os.path.abspath(run_dir),
            "code": "", "config": {}}
    if nodes:
        view.update(code=code_fingerprint(), config=flat_config(cfg))
    return view


def check_agreement(run_dir: str, cfg) -> None:
    """Every rank: the same run directory path; across nodes also the same code and config, and a shared run
    folder."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    nodes = env_spans_nodes()
    views: List[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(views, _view(run_dir, cfg, nodes))
    problems = _differences(views)
    if problems:
        raise ConfigError(problems)
    if nodes:
        check_shared_folder(run_dir)


def _differences(views: List[dict]) -> List[str]:
    first = views[0]
    dirs = sorted({v["run_dir"] for v in views})
    if len(dirs) > 1:
        return [f"ranks disagree on the run directory ({dirs[:2]} ...); set hydra.run.dir=<one path> on every node"]
    problems = []
    code = [v for v in views if v["code"] != first["code"]]
    if code:
        problems.append(f"the nodes run different code: {_who(code)} run(s) other Tessera sources or library "
                        f"versions than rank 0 on {first['host']}; install the same checkout and environment on "
                        f"every node")
    for view in views[1:]:
        keys = sorted(k for k in set(first["config"]) | set(view["config"])
                      if first["config"].get(k) != view["config"].get(k))
        if keys:
            shown = ", ".join(f"{k}={view['config'].get(k)} (rank 0: {first['config'].get(k)})" for k in keys[:4])
            problems.append(f"rank {view['rank']} on {view['host']} runs another config than rank 0: {shown}"
                            f"{' ...' if len(keys) > 4 else ''}; start every node with the same overrides")
            break  # the first rank that differs says enough
    return problems


def _who(views: List[dict]) -> str:
    hosts = sorted({f"{v['host']} (rank {v['rank']})" for v in views})
    return ", ".join(hosts[:3]) + (" ..." if len(hosts) > 3 else "")


def check_shared_folder(run_dir: str) -> None:
    """Each node's first rank writes a probe into the run directory; every one of them must then see every
    node's probe, or the folder is not one shared file system (checkpoints would be split over the nodes)."""
    probes = Path(run_dir) / PROBE_DIR
    first_of_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    token = secrets.token_hex(8)
    if first_of_node:
        probes.mkdir(parents=True, exist_ok=True)
        (probes / f"rank{dist.get_rank()}").write_text(token)
    written: List[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(written, {"rank": dist.get_rank(), "host": socket.gethostname(),
                                     "token": token if first_of_node else None})
    missing = []
    if first_of_node:
        for peer in written:
            path = probes / f"rank{peer['rank']}"
            if peer["token"] and (not path.is_file() or path.read_text() != peer["token"]):
                missing.append(peer)
    seen: List[list] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(seen, [(socket.gethostname(), dist.get_rank(), m["host"], m["rank"]) for m in missing])
    if dist.get_rank() == 0:
        shutil.rmtree(probes, ignore_errors=True)
    blind = [entry for entries in seen for entry in entries]
    if blind:
        host, rank, other_host, other_rank = blind[0]
        raise TesseraError(f"the run directory {os.path.abspath(run_dir)} is not shared by the nodes: rank {rank} "
                           f"on {host} does not see the probe rank {other_rank} on {other_host} wrote there; set "
                           f"hydra.run.dir to a folder on a file system every node mounts", same_on_every_rank=True)
