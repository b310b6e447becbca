"""Loading a checkpoint never runs code from a file: DCP's pickled metadata is read with an allow-list."""
from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tessera.errors import CheckpointError
from trainer.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/tessera-pwned",))


def test_real_metadata_loads_and_round_trips(tmp_path):
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    meta = SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert set(meta.state_dict_metadata) == {"model.w", "model.b"}
    target = {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}}
    dcp.load(target, checkpoint_id=tmp_path, storage_reader=SafeFileSystemReader(str(tmp_path)),
             planner=SafeLoadPlanner(), no_dist=True)
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    assert torch.equal(target["model"]["b"], state["model"]["b"])


def test_metadata_that_would_run_code_is_refused(tmp_path):
    marker = "/tmp/tessera-pwned"
    if os.path.exists(marker):
        os.remove(marker)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(CheckpointError, match="refusing to load it"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not os.path.exists(marker)
