"""Preference pairs (data=preference) for the preference objectives (trainer/objectives/).

A record holds a prompt and two responses, `chosen` and `rejected`, in the shapes users have:
- TRL's standard form: {prompt: text, chosen: text, rejected: text};
- TRL's conversational form: {prompt: [messages], chosen: [messages], rejected: [messages]};
- an implicit prompt: {chosen: [conversation], rejected: [conversation]} whose shared opening turns are the prompt;
- the prompt as a chat or ShareGPT conversation: {messages or conversations: [...], chosen, rejected}, chosen and
  rejected as text, one message ({role, content} or ShareGPT's {from, value}) or a list of messages (LLaMA-Factory);
plus `system` and `tools` as for SFT data, and data.columns / data.roles for other names (trainer/data/sources.py
normalises every turn). Each side is rendered with the chat template as prompt + response (data=sft's rendering),
the loss on the response's assistant turns only.

Storage: a token store of kind sft whose documents are chosen_0, rejected_0, chosen_1, ... . A pair is one item
of the sampler (train.global_batch_size counts pairs) and two rows of a batch, chosen then rejected, so no pair is
ever split across micro-batches or ranks. Pairs are never truncated: a pair with a side longer than data.seq_len + 1
tokens, or a side without a response token, is skipped and counted (the log says how many).
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from tessera.errors import DataError
from trainer.data import sft, sources
from trainer.data.store import TokenStore

IGNORE = -100  # trainer/data/datasets.py's (which imports this module)


def preference_records(data_cfg) -> sources.Records:
    """Preference records from data.path, or the hub dataset data.name: chosen and rejected fields needed."""
    ds, where = sources.dataset_of(data_cfg, "data.path=<a local copy of the records>")
    cols, m = set(ds.column_names), sources.mapping_of(data_cfg)
    need = [m.field("chosen"), m.field("rejected")]
    if not set(need) <= cols:
        raise DataError(f"{where}: preference records need {m.named('chosen')} and {m.named('rejected')} (with "
                        f"{m.named('prompt')}, {m.named('messages')} or {m.named('conversations')} for the prompt, "
                        f"or a shared opening of the two conversations); found fields: "
                        f"{', '.join(sorted(cols)) or 'none'}; where yours go by other names, map them: "
                        f"data.columns={{prompt: <field>, chosen: <field>, rejected: <field>}} (docs/data.md)")
    return sources.Records(ds, where, "preference", sources.limited(ds, data_cfg), m)


def preference_pair(rec: dict, i: int, where: str, mapping: sources.Mapping):
    """One record -> (chosen Conversation, rejected Conversation): the prompt's turns untrained, then each
    response's turns (its assistant turns trained)."""
    f = mapping.field
    prompt = _prompt_turns(rec, i, where, mapping)
    sides = [_response_turns(rec.get(f(side)), i, where, mapping, f(side)) for side in ("chosen", "rejected")]
    if prompt is None:  # an implicit prompt: the turns both conversations open with
        shared = 0
        while shared < min(map(len, sides)) - 1 and sides[0][shared] == sides[1][shared]:
            shared += 1
        prompt, sides = sides[0][:shared], [s[shared:] for s in sides]
    prompt = [dict(t, train=False) for t in prompt]
    tools = sources.tools_of(rec.get(f("tools")), i, where, f("tools"))
    for side, turns in zip(("chosen", "rejected"), sides):
        if not any(t["train"] for t in turns):
            raise DataError(f"{where}: record {i}: the {side} response has no assistant turn to learn from")
    return tuple(sources.Conversation(prompt + turns, tools) for turns in sides)


def _prompt_turns(rec: dict, i: int, where: str, mapping: sources.Mapping) -> Optional[list]:
    f = mapping.field
    system = sources.system_turn(rec, mapping)
    prompt = rec.get(f("prompt"))
    if isinstance(prompt, str):
        return system + [{"role": "user", "content": prompt, "train": False}]
    if prompt is not None:
        return system + sources.turns(prompt, i, where, mapping, sharegpt=False)
    for name, sharegpt in (("messages", False), ("conversations", True)):
        if rec.get(f(name)) is not None:
            return system + sources.turns(rec[f(name)], i, where, mapping, sharegpt=sharegpt)
    return None


def _response_turns(value, i: int, where: str, mapping: sources.Mapping, key: str) -> list:
    """A response: text (one assistant turn), one message, or a list of messages."""
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: record {i} field {key!r} is empty")
        return [{"role": "assistant", "content": value, "train": True}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: record {i} field {key!r} must be text, a message or a list of messages "
                        f"(got {type(value).__name__})")
    sharegpt = "from" in value[0] and mapping.columns.get("role") is None
    return sources.turns(value, i, where, mapping, sharegpt=sharegpt)


def pair_items(records: sources.Records, tokenizer, indices: Optional[range] = None
               ) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """(token ids, response mask) of each record's chosen side, then its rejected side."""
    for i, rec in records.rows(indices):
        for conv in preference_pair(rec, i, records.where, records.mapping):
            yield sft.encode_conversation(tokenizer, conv.messages, conv.tools)


class PreferencePairs:
    """The pairs of a preference store as training items: item k is pair keep[k], two rows of seq_len positions
    (chosen, rejected), padded, labels on the responses only. `reference`: [pairs, 2] log-probabilities of the
    reference model (chosen, rejected) by stored pair, attached by trainer/objectives/reference.py."""

    def __init__(self, store: TokenStore, seq_len: int, pad_id: int):
        self.tokens, self.mask, self.seq_len, self.pad_id = store.tokens, store.mask, seq_len, pad_id
        offsets = np.asarray(store.offsets, dtype=np.int64)
        if (len(offsets) - 1) % 2:
            raise DataError("the preference store holds an odd number of responses; delete the cache entry")
        self.offsets, lengths = offsets, np.diff(offsets)
        csum = np.concatenate([[0], np.cumsum(np.asarray(self.mask, dtype=np.int64))])
        targets = csum[offsets[1:]] - csum[np.minimum(offsets[:-1] + 1, offsets[1:])]
        fits = ((lengths <= seq_len + 1) & (targets > 0)).reshape(-1, 2).all(1)
        self.keep = np.nonzero(fits)[0]  # stored pairs that train
        self.num_pairs, self.dropped = len(fits), int(len(fits) - len(self.keep))
        self.targets = targets.reshape(-1, 2).sum(1)
        self.reference: Optional[np.ndarray] = None
        if not len(self.keep):
            raise DataError(f"no preference pair fits data.seq_len={seq_len} with a response token on both sides; "
                            f"raise data.seq_len")

    def __len__(self):
        return len(self.keep)

    def get(self, indices) -> dict:
        pairs = self.keep[np.asarray(indices, dtype=np.int64)]
        docs = np.stack([2 * pairs, 2 * pairs + 1], 1).reshape(-1)  # chosen, rejected, chosen, ...
        L = self.seq_len
        ids = np.full((len(docs), L + 1), self.pad_id, dtype=np.int64)
        tgt = np.zeros((len(docs), L + 1), dtype=bool)
        for row, doc in enumerate(docs.tolist()):
            lo, hi = int(self.offsets[doc]), int(self.offsets[doc + 1])
            ids[row, :hi - lo] = self.tokens[lo:hi]
            tgt[row, :hi - lo] = np.asarray(self.mask[lo:hi], dtype=bool)
        batch = {"input_ids": torch.from_numpy(ids[:, :-1].copy()),
                 "labels": torch.from_numpy(np.where(tgt[:, 1:], ids[:, 1:], IGNORE)),
                 "pair_ids": torch.from_numpy(pairs.copy())}
        if self.reference is not None:
            batch["reference_logps"] = torch.from_numpy(self.reference[pairs].reshape(-1).copy())
        return batch

    def count_targets(self, indices) -> int:
        """Target tokens of both sides of the pairs (the step's `tokens`; the loss counts pairs)."""
        return int(self.targets[self.keep[np.asarray(indices, dtype=np.int64)]].sum())


def holds_pairs(d) -> bool:
    """Whether the data config gives preference pairs: data.kind=preference, or a mixture of preference sources."""
    return d.kind == "preference" or (d.kind == "mixture" and bool(d.sources) and
                                      all(s.kind == "preference" for s in d.sources))


def pair_problems(d) -> List[str]:
    """data.kind=preference's checks before any process group."""
    problems = []
    if d.packing != "eos":
        problems.append("data.packing=documents is not available with data.kind=preference: each response is a "
                        "row of its own; set data.packing=eos")
    if d.streaming or d.follow:
        problems.append("data.streaming / data.follow are not available with data.kind=preference (the reference "
                        "model scores every pair before training)")
    if d.kind == "preference" and not d.path and not d.name:
        problems.append("data.kind=preference needs data.path (JSON / JSONL / parquet records) or data.name (a hub "
                        "dataset)")
    return problems
