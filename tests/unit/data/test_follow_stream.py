"""trainer/data/follow.py on files written by the test: whole lines only, bad records skipped and counted, large
files read in pieces, every stream token after the first a target once, replay from trained records only, and the
checkpoint state giving the same continuation."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from models.tokenizer import embedded_tokenizer
from trainer.data import follow
from trainer.data.follow import FollowStream, _last_line_end

SEQ = 8


def _data(path, **kw):
    d = dict(path=str(path), text_field="text", seq_len=SEQ, follow_replay=0.0, follow_poll_s=0.1,
             follow_idle_timeout_s=0.0)
    d.update(kw)
    return SimpleNamespace(**d)


def _line(i: int) -> str:
    return json.dumps({"text": f"record number {i} " + "x" * (i % 5)}) + "\n"


@pytest.fixture(scope="module")
def tokenizer():
    return embedded_tokenizer()


def test_only_whole_lines_are_read_and_bad_records_are_counted(tmp_path, tokenizer):
    path = tmp_path / "s.jsonl"
    path.write_text(_line(0) + "not json\n" + json.dumps({"body": "no text field"}) + "\n" + _line(1) + '{"text": "half')
    stream = FollowStream(_data(path), tokenizer)
    limits = stream.visible()
    assert limits == {"s.jsonl": path.read_bytes().rfind(b"\n") + 1}  # the last line has no newline yet
    assert stream.read(limits) == 2 and stream.skipped == 2
    expected = sum(len(tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]) + 1
                   for line in (_line(0), _line(1)))
    assert len(stream.buffer) == expected
    assert stream.read(stream.visible()) == 0  # nothing new: the half line waits
    with open(path, "a") as fh:
        fh.write(' line"}\n')
    assert stream.read(stream.visible()) == 1


def test_a_file_shorter_than_what_was_read_is_an_error(tmp_path, tokenizer):
    from tessera.errors import DataError

    path = tmp_path / "s.jsonl"
    path.write_text(_line(0) + _line(1))
    stream = FollowStream(_data(path), tokenizer)
    stream.read(stream.visible())
    path.write_text(_line(5))  # rotated: a new, shorter file under the same name
    with pytest.raises(DataError, match="was truncated or replaced"):
        stream.visible()


def test_large_files_are_read_in_pieces_of_whole_lines(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(follow, "READ_BYTES", 100)
    path = tmp_path / "big.jsonl"
    path.write_text("".join(_line(i) for i in range(40)))
    stream = FollowStream(_data(path), tokenizer)
    limits = stream.visible()
    reads = []
    while stream.offsets.get("big.jsonl", 0) < limits["big.jsonl"]:
        reads.append(stream.read(limits))
    assert sum(reads) == 40 and len(reads) > 5 and all(reads)
    with open(path, "rb") as fh:
        assert _last_line_end(fh, 0) == path.stat().st_size


def test_every_token_after_the_first_is_a_target_once_and_records_finish_in_order(tmp_path, tokenizer):
    path = tmp_path / "s.jsonl"
    path.write_text("".join(_line(i) for i in range(30)))
    stream = FollowStream(_data(path), tokenizer)
    stream.read(stream.visible())
    everything = stream.buffer.copy()
    targets, finished = [], []
    while len(stream.buffer) >= 3 * SEQ + 1:
        windows, done = stream.take(3, SEQ)
        targets += windows[:, 1:].reshape(-1).tolist()
        finished += done
    assert targets == everything[1:1 + len(targets)].tolist()
    offsets = [0]
    for i in range(29):
        offsets.append(offsets[-1] + len(_line(i)))
    assert finished == [["s.jsonl", off] for off in offsets[:len(finished)]]
    assert len(finished) >= 25


def test_the_checkpoint_state_continues_the_same_stream_and_replay(tmp_path, tokenizer):
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(_line(i) for i in range(20)))
    (folder / "b.jsonl").write_text("".join(_line(i) for i in range(20, 40)))
    (folder / "ignored.txt").write_text("not followed\n")
    first = FollowStream(_data(folder, follow_replay=0.5), tokenizer)  # replay: the trained records are kept
    first.read(first.visible())
    first.take(4, SEQ)
    state = json.loads(json.dumps(first.state_dict()))  # as meta.json carries it
    second = FollowStream(_data(folder, follow_replay=0.5), tokenizer)
    second.load_state_dict(state)
    assert second.records == first.records  # replay history: the trained records, rebuilt from the files
    rng = lambda: np.random.Generator(np.random.PCG64(3))  # noqa: E731
    assert np.array_equal(first.replayed(2, SEQ, rng()), second.replayed(2, SEQ, rng()))
    a, done_a = first.take(5, SEQ)
    b, done_b = second.take(5, SEQ)
    assert np.array_equal(a, b) and done_a == done_b
    assert sorted(first.offsets) == ["a.jsonl", "b.jsonl"]


def test_follow_problems_name_the_keys(compose, tmp_path):
    from trainer.config import schema as C

    problems = C.validate(compose(["data=text", f"data.path={tmp_path}/nothing.jsonl", "data.follow=true",
                                   "eval.every=10"]), 1)
    assert any("data.follow=true: data.path=" in p and "does not exist" in p for p in problems), problems
    assert any("set eval.every=0" in p for p in problems), problems
    problems = C.validate(compose(["data=sft", f"data.path={tmp_path}", "data.follow=true", "eval.every=0"]), 1)
    assert any("data.kind=sft is not followed" in p for p in problems), problems
    (tmp_path / "records.jsonl.gz").write_bytes(b"\x1f\x8b")
    problems = C.validate(compose(["data=text", f"data.path={tmp_path}/records.jsonl.gz", "data.follow=true",
                                   "eval.every=0"]), 1)
    assert any("data.follow=true reads records appended as lines to a .jsonl file" in p for p in problems), problems
