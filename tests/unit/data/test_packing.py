"""data.packing=documents: several documents per sequence with restarting position ids. The rows hold every
document's tokens once, never predict across documents, and a Hugging Face model given the packed row computes
the same losses as on each document alone (attention kept inside each document)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.tokenizer import embedded_tokenizer
from trainer.config.schema import DataConfig, TesseraConfig
from trainer.data.datasets import IGNORE, DocumentPackedSequences, build_data
from trainer.data.store import build_or_load

VOCAB = 264
EOS = 256


def _store(tmp_path, docs, kind="text", masks=None):
    items = lambda: ((d, None if masks is None else m) for d, m in zip(docs, masks or [None] * len(docs)))  # noqa
    return build_or_load(str(tmp_path / "cache"), {"test": "packing"}, kind, VOCAB, items, lambda m: None)


def _text_docs(seed=0, n=40):
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(0, 250, size=int(rng.integers(1, 30))), EOS) for _ in range(n)]


def _pairs_of(doc, seq_len):
    """(input, label, position) triples of a document trained alone in windows of seq_len + 1 tokens."""
    out = []
    for a in range(0, len(doc) - 1, seq_len):
        piece = doc[a:a + seq_len + 1]
        out += [(int(piece[t]), int(piece[t + 1]), t) for t in range(len(piece) - 1)]
    return out


def test_rows_hold_every_document_once_and_never_predict_across_documents(tmp_path):
    docs = _text_docs()
    seq_len = 16  # shorter than some documents: those are cut into pieces overlapping by one token
    seqs = DocumentPackedSequences(_store(tmp_path, docs), seq_len, pad_id=0)
    batch = seqs.get(np.arange(len(seqs)))
    ids, labels, pos = batch["input_ids"].numpy(), batch["labels"].numpy(), batch["position_ids"].numpy()
    assert ids.shape == labels.shape == pos.shape == (len(seqs), seq_len)
    got = []
    for r in range(len(seqs)):
        for t in range(seq_len):
            if labels[r, t] != IGNORE:
                got.append((int(ids[r, t]), int(labels[r, t]), int(pos[r, t])))
    expected = [p for d in docs for p in _pairs_of(d, seq_len)]
    assert got == expected  # in corpus order, each position of each document once, positions from 0
    assert seqs.count_targets(np.arange(len(seqs))) == len(expected)
    assert [seqs.count_targets([r]) for r in range(len(seqs))] == [int((labels[r] != IGNORE).sum())
                                                                   for r in range(len(seqs))]
    # rows are filled: a row ends only where the next piece does not fit
    used = (labels != IGNORE).sum(1)
    first_piece = [int(seqs.lengths[seqs.row_ptr[r]]) for r in range(len(seqs))]
    assert all(used[r] + first_piece[r + 1] > seq_len for r in range(len(seqs) - 1))
    assert seqs.num_pieces == sum(-(-(len(d) - 1) // seq_len) for d in docs)  # cut every seq_len positions
    assert len(seqs) < seqs.num_pieces  # rows hold several pieces
    # padding is a piece of its own (positions from 0) without loss
    r = int(np.argmin(used))
    assert (pos[r, used[r]:] == np.arange(seq_len - used[r])).all()


def test_sft_examples_pack_with_their_masks(tmp_path):
    rng = np.random.default_rng(1)
    docs, masks = [], []
    for i in range(12):
        n = int(rng.integers(4, 12))
        docs.append(rng.integers(0, 250, size=n))
        masks.append((np.arange(n) >= n // 2).astype(np.uint8) if i != 3 else np.zeros(n, np.uint8))
    seqs = DocumentPackedSequences(_store(tmp_path, docs, "sft", masks), 20, pad_id=0)
    assert seqs.dropped == 1  # example 3 has no response token
    batch = seqs.get(np.arange(len(seqs)))
    ids, labels = batch["input_ids"].numpy(), batch["labels"].numpy()
    got = [(int(i), int(lab)) for i, lab in zip(ids.ravel(), labels.ravel()) if lab != IGNORE]
    expected = [(int(d[t]), int(d[t + 1])) for i, (d, m) in enumerate(zip(docs, masks)) if i != 3
                for t in range(len(d) - 1) if m[t + 1]]
    assert got == expected


def test_build_data_packs_documents_and_names_it_in_the_fingerprint(tmp_path):
    tok = embedded_tokenizer()
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": "word " * (3 + i % 17)}) + "\n" for i in range(60)))

    def data(packing):
        cfg = TesseraConfig()
        cfg.data = DataConfig(kind="text", path=str(path), seq_len=64, val_fraction=0.1,
                              cache_dir=str(tmp_path / "cache"), packing=packing)
        return build_data(cfg, tok, VOCAB, log=lambda m: None)

    eos, docs = data("eos"), data("documents")
    assert "position_ids" not in eos.train.get([0]) and "position_ids" in docs.train.get([0])
    assert docs.fingerprint == eos.fingerprint + ":pdocuments"
    assert "packed with restarting positions" in docs.description


# Architectures whose forward reads restarting position ids as packed documents (sliding-window, absolute
# position embeddings and MoE included); gemma2 has no SDPA path in transformers.
ARCHS = {
    "llama": {}, "qwen3": {}, "gemma2": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4), "mixtral": dict(num_local_experts=2, num_experts_per_tok=1),
    "gpt_neox": {},
}
CASES = [(m, a) for m in ARCHS for a in ("sdpa", "eager") if not (m == "gemma2" and a == "sdpa")]


def _tiny(model_type, attn, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=VOCAB, head_dim=16, pad_token_id=0, bos_token_id=1,
              eos_token_id=EOS, max_position_embeddings=64)
    kw.update(extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), attn_implementation=attn).eval()


def _packed_row():
    rng = np.random.default_rng(2)
    docs = [torch.from_numpy(rng.integers(0, 250, size=n)) for n in (7, 11, 5)]
    ids = torch.cat([d[:-1] for d in docs] + [torch.zeros(4, dtype=torch.long)])[None]
    labels = torch.cat([d[1:] for d in docs] + [torch.full((4,), IGNORE)])[None]
    positions = torch.cat([torch.arange(len(d) - 1) for d in docs] + [torch.arange(4)])[None]
    return docs, ids, labels, positions


@pytest.mark.parametrize("model_type,attn", CASES)
def test_a_packed_row_trains_what_its_documents_train_alone(model_type, attn):
    from models.packing import PackedForward, takes_position_ids

    model = _tiny(model_type, attn, **ARCHS[model_type])
    assert takes_position_ids(model.config)
    docs, ids, labels, positions = _packed_row()
    forward = PackedForward()
    with torch.no_grad():
        packed = forward(model, ids, positions).logits
        alone = [model(input_ids=d[None, :-1], use_cache=False).logits for d in docs]
    assert forward.verified
    packed_loss = F.cross_entropy(packed[0], labels[0], ignore_index=IGNORE, reduction="sum")
    alone_loss = sum(F.cross_entropy(a[0], d[1:], reduction="sum") for a, d in zip(alone, docs))
    second = slice(len(docs[0]) - 1, len(docs[0]) + len(docs[1]) - 2)
    assert torch.allclose(packed[0, :len(docs[0]) - 1], alone[0][0], atol=1e-5)
    assert torch.allclose(packed[0, second], alone[1][0], atol=1e-5)
    assert abs(packed_loss.item() - alone_loss.item()) / alone_loss.item() < 1e-6
    # without the position ids the second document would attend to the first: the check can fail
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
    assert not torch.allclose(plain[0, second], alone[1][0], atol=1e-3)


def test_a_model_whose_mask_ignores_the_position_ids_is_stopped_at_its_first_packed_batch():
    """OPT takes position_ids for its position embeddings but builds its mask without them: its documents would
    attend to each other. Its first packed forward says so, also after another model of the same process (a Hydra
    multirun's earlier job) passed the check."""
    from models.packing import PackedForward
    from tessera.errors import ModelError

    model = _tiny("opt", "sdpa", ffn_dim=128, word_embed_proj_dim=64)
    _, ids, _, positions = _packed_row()
    forward = PackedForward()
    llama = _tiny("llama", "sdpa", **ARCHS["llama"])
    forward(llama, ids, positions)
    assert forward.verified
    with pytest.raises(ModelError, match="does not read restarting position ids as packed documents"):
        forward(model, ids, positions)


def test_models_without_position_ids_are_refused_before_training():
    from transformers import AutoConfig

    from models.packing import takes_position_ids

    assert not takes_position_ids(AutoConfig.for_model("bloom", hidden_size=64, n_layer=2, n_head=4))
    assert takes_position_ids(AutoConfig.for_model("llama"))


def test_packed_documents_with_pipeline_stages_and_the_refusals():
    """pp takes packed documents (each stage is handed their position ids), with context ranks too."""
    from tests.conftest import compose_config
    from tessera.errors import ConfigError
    from trainer.run.build import check

    check(compose_config(["strategy=pp", "data.packing=documents"]), 2)
    check(compose_config(["strategy=pp", "strategy.pp=2", "strategy.cp=2", "data.packing=documents"]), 4)
    with pytest.raises(ConfigError, match="data.packing='tokens' is not one of eos, documents"):
        check(compose_config(["data.packing=tokens"]), 1)
    check(compose_config(["data.packing=documents"]), 1)  # the default model takes them
