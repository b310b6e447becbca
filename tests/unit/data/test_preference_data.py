"""data=preference (trainer/data/preference.py): the record shapes users have become the same pairs of rendered
conversations (prompt untrained, the response's assistant turns trained), a pair is one item of two rows (chosen,
rejected) that is never split, pairs too long for data.seq_len are skipped and counted, and bad records get one
message naming the record. The embedded byte-level tokenizer (one token per byte) makes the trained text exact."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.tokenizer import embedded_tokenizer
from tessera.errors import DataError
from trainer.config.schema import DataConfig, TesseraConfig
from trainer.data.datasets import IGNORE, build_data
from trainer.data.tokenizing import store_kind

VOCAB = 264
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok():
    return embedded_tokenizer()


def _build(tmp_path, records, name="pairs.jsonl", log=None, **data):
    path = Path(tmp_path) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    cfg = TesseraConfig()
    cfg.data = DataConfig(kind="preference", path=str(path), cache_dir=str(Path(tmp_path) / "cache"),
                          val_fraction=0.0, seq_len=data.pop("seq_len", 256), **data)
    return build_data(cfg, embedded_tokenizer(), VOCAB, log=log or (lambda m: None))


def _sides(tok, data, item=0):
    """(rendered chosen row, its trained text, rendered rejected row, its trained text) of one pair."""
    batch = data.train.get([item])
    assert batch["input_ids"].shape[0] == 2 and batch["pair_ids"].tolist() == [data.train.indices[item]]
    out = []
    for row in range(2):
        ids, labels = batch["input_ids"][row], batch["labels"][row]
        out += [tok.decode(ids[ids != tok.pad_token_id]), tok.decode(labels[labels != IGNORE])]
    return out


STANDARD = {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Seven."}


def test_the_standard_form_trains_the_responses_only(tmp_path, tok):
    chosen, trained_c, rejected, trained_r = _sides(tok, _build(tmp_path, [STANDARD]))
    assert chosen == f"<|user|>\nName a colour.\n<|assistant|>\nBlue.{EOS}\n"  # the template's newline: no loss
    assert trained_c == f"Blue.{EOS}" and trained_r == f"Seven.{EOS}"
    assert rejected.startswith("<|user|>\nName a colour.\n<|assistant|>\nSeven")


@pytest.mark.parametrize("record", [
    {"prompt": [{"role": "user", "content": "Name a colour."}], "chosen": [{"role": "assistant", "content": "Blue."}],
     "rejected": [{"role": "assistant", "content": "Seven."}]},
    {"chosen": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
     "rejected": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Seven."}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
     "chosen": {"role": "assistant", "content": "Blue."}, "rejected": "Seven."},
    {"conversations": [{"from": "human", "value": "Name a colour."}], "chosen": {"from": "gpt", "value": "Blue."},
     "rejected": {"from": "gpt", "value": "Seven."}},
], ids=["conversational", "implicit-prompt", "messages-prompt", "sharegpt"])
def test_every_shape_gives_the_standard_forms_pair(tmp_path, tok, record):
    expected = _sides(tok, _build(tmp_path / "standard", [STANDARD]))
    assert _sides(tok, _build(tmp_path / "shape", [record])) == expected


def test_column_names_map(tmp_path, tok):
    record = {"question": "Name a colour.", "good": "Blue.", "bad": "Seven."}
    mapped = _build(tmp_path / "m", [record], columns={"prompt": "question", "chosen": "good", "rejected": "bad"})
    assert _sides(tok, mapped) == _sides(tok, _build(tmp_path / "s", [STANDARD]))


def test_a_pair_is_one_item_of_two_rows_and_counts_both_responses_tokens(tmp_path, tok):
    records = [{"prompt": f"Q{i}?", "chosen": "yes" * (i + 1), "rejected": "no"} for i in range(6)]
    data = _build(tmp_path, records)
    assert len(data.train) == 6
    batch = data.train.get([0, 3, 5])
    assert batch["input_ids"].shape == (6, 256) and batch["labels"].shape == (6, 256)
    assert batch["pair_ids"].tolist() == [0, 3, 5]
    trained = [tok.decode(r[r != IGNORE]) for r in batch["labels"]]
    assert trained == [f"yes{EOS}", f"no{EOS}", f"{'yes' * 4}{EOS}", f"no{EOS}", f"{'yes' * 6}{EOS}", f"no{EOS}"]
    assert data.train.count_targets([0, 3, 5]) == sum(len(t) - len(EOS) + 1 for t in trained)


def test_pairs_longer_than_seq_len_are_skipped_and_counted(tmp_path, tok):
    records = [STANDARD, {"prompt": "Long?", "chosen": "x" * 300, "rejected": "no"}, STANDARD]
    said = []
    data = _build(tmp_path, records, log=said.append, seq_len=64)
    assert len(data.train) == 2 and data.train.get([1])["pair_ids"].tolist() == [2]
    assert any("1 preference pairs have a side longer than data.seq_len=64" in m for m in said), said
    with pytest.raises(DataError, match="no preference pair fits data.seq_len=8"):
        _build(tmp_path / "none", [STANDARD], seq_len=8)


@pytest.mark.parametrize("record,message", [
    ({"prompt": "Q?", "chosen": "", "rejected": "no"}, "record 1 field 'chosen' is empty"),
    ({"prompt": "Q?", "chosen": 3, "rejected": "no"}, "record 1 field 'chosen' must be text, a message or a list"),
    ({"prompt": "Q?", "chosen": [{"role": "user", "content": "hm"}], "rejected": "no"},
     "record 1: the chosen response has no assistant turn to learn from"),
])
def test_a_bad_record_is_named(tmp_path, record, message):
    with pytest.raises(DataError, match=message):
        _build(tmp_path, [STANDARD, record])


def test_records_of_another_shape_list_their_fields_and_the_mapping(tmp_path):
    with pytest.raises(DataError) as e:
        _build(tmp_path, [{"question": "Q?", "answer": "A."}])
    assert "preference records need 'chosen' and 'rejected'" in str(e.value)
    assert "found fields: answer, question" in str(e.value)
    assert "data.columns={prompt: <field>, chosen: <field>, rejected: <field>}" in str(e.value)


def test_the_tokenize_command_refuses_preference_data():
    """python -m trainer.tokenize builds text and SFT stores; preference pairs are tokenized by the run itself."""
    with pytest.raises(DataError, match="data=preference has no token store of its own"):
        store_kind(DataConfig(kind="preference", path="pairs.jsonl"))


def test_json_parquet_and_hub_records_give_the_jsonl_pairs(tmp_path, tok, monkeypatch):
    """The same records as a JSON array, a parquet file and a hub dataset (datasets.load_dataset answering for the
    hub) give the JSONL file's pairs token for token."""
    import datasets

    records = [STANDARD, {"prompt": "Count to two.", "chosen": "One, two.", "rejected": "Two, one."}]
    want = _build(tmp_path / "jsonl", records)
    as_json = tmp_path / "json" / "pairs.json"
    as_json.parent.mkdir()
    as_json.write_text(json.dumps(records))
    as_parquet = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list(records).to_parquet(str(as_parquet))
    real, calls = datasets.load_dataset, []

    def load_dataset(name, *args, **kw):  # the hub's name answered with the records; files read for real
        calls.append(name)
        return datasets.Dataset.from_list(records) if name == "org/pairs" else real(name, *args, **kw)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)

    def config(**data):
        cfg = TesseraConfig()
        cfg.data = DataConfig(kind="preference", cache_dir=str(tmp_path / "cache"), val_fraction=0.0, seq_len=256,
                              **data)
        return cfg

    for cfg in (config(path=str(as_json)), config(path=str(as_parquet)), config(name="org/pairs")):
        got = build_data(cfg, tok, VOCAB, log=lambda m: None)
        for key in ("input_ids", "labels"):
            assert np.array_equal(got.train.get([0, 1])[key], want.train.get([0, 1])[key]), cfg.data
    assert calls[-1] == "org/pairs" and "parquet" in calls
