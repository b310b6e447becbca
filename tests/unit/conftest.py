"""Fixtures of the unit tests."""
from __future__ import annotations

import socket

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo group in this process (DTensors need a mesh; collectives need a group)."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
