"""data.packing=documents end to end: several documents per sequence with restarting position ids train the same
losses under the layouts that run them (single process, fsdp, tp, pp; real processes with gloo), SFT examples
pack with their response masks."""
from __future__ import annotations


import pytest

from tests.integration.conftest import SMALL, check_parity, launch, metrics, ok, short_documents

STEPS = 4


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    return short_documents(tmp_path_factory.mktemp("packing") / "docs.jsonl")


def _overrides(data):
    return [o for o in SMALL if not o.startswith("data.")] + data + [
        "data.packing=documents", "data.seq_len=64", f"train.max_steps={STEPS}", "train.log_every=1",
        "train.global_batch_size=8", "train.micro_batch_size=2", "eval.every=0", "eval.at_end=false",
        "export.hf_at_end=false", "checkpoint.at_end=false"]


@pytest.fixture(scope="module")
def reference(documents, tmp_path_factory):
    run = tmp_path_factory.mktemp("packed-single")
    ok(launch("python", _overrides(["data=text", f"data.path={documents}"]) + ["strategy=single"], run))
    return metrics(run)


@pytest.mark.parametrize("strategy,extra", [("fsdp", []), ("tp", []), ("pp", ["strategy.pp_schedule=1f1b"])])
def test_packed_documents_train_the_same_losses_on_every_layout(documents, reference, tmp_path, strategy, extra):
    ok(launch("torchrun", _overrides(["data=text", f"data.path={documents}"]) + [f"strategy={strategy}", *extra],
              tmp_path, nproc=2))
    check_parity(f"packing=documents {strategy}", metrics(tmp_path), reference, steps=STEPS)


def test_packed_sft_trains_several_examples_per_sequence(generated_data, tmp_path):
    """The generated examples are ~200 tokens: packed into 512-token sequences, each sequence holds about two,
    so a step of the same number of sequences trains about twice the response tokens of one example each."""
    tokens = {}
    for packing in ("eos", "documents"):
        run = tmp_path / packing
        overrides = _overrides(["data=sft", f"data.path={generated_data.alpaca}"]) + [
            "strategy=single", "data.seq_len=512", "train.global_batch_size=4", f"data.packing={packing}"]
        ok(launch("python", overrides, run))
        recs = metrics(run)
        assert len(recs) == STEPS and recs[-1]["loss"] < recs[0]["loss"]
        tokens[packing] = recs[-1]["tokens"]
    print(f"SFT target tokens in {STEPS} steps of 4 sequences: eos {tokens['eos']}, documents {tokens['documents']}")
    assert tokens["documents"] > 1.6 * tokens["eos"]
