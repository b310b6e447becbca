"""trainer/exporting/snapshots.py without a run: what an interrupted run left is cleared, `current` names the newest
published snapshot, old ones go, and the one `current` names never does (a resumed run publishing a lower step)."""
from __future__ import annotations

import os

from trainer.exporting.snapshots import Snapshots


def _publish(snaps, step):
    os.makedirs(snaps.folder(step))
    snaps.publish(step)


def test_current_follows_publish_and_only_the_newest_are_kept(tmp_path):
    root = tmp_path / "snapshots"
    (root / "step_8.tmp").mkdir(parents=True)  # a half-written export
    os.symlink("step_8", root / "current.tmp")  # a switch cut short
    snaps = Snapshots(str(tmp_path), every=2, keep=2, writes=True)
    assert sorted(os.listdir(root)) == []
    for step in (2, 4, 6):
        _publish(snaps, step)
        assert os.readlink(root / "current") == f"step_{step}"
    assert sorted(os.listdir(root)) == ["current", "step_4", "step_6"]
    _publish(snaps, 3)  # resumed from an earlier checkpoint: its snapshot is current, however old its number
    assert os.readlink(root / "current") == "step_3"
    assert sorted(os.listdir(root)) == ["current", "step_3", "step_4", "step_6"]
    assert snaps.due(4) and not snaps.due(3)
    assert not Snapshots(str(tmp_path), every=0, keep=2, writes=True).due(4)


def test_other_ranks_touch_nothing(tmp_path):
    snaps = Snapshots(str(tmp_path), every=1, keep=2, writes=False)
    snaps.publish(1)
    assert not (tmp_path / "snapshots").exists()
