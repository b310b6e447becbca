"""SFT records in the shapes users have (docs/data.md, "Chat data shapes"): chat `messages` with text or typed
content parts, ShareGPT `conversations`, tools and tool calls, per-message loss weights, data.columns and
data.roles, and the one message an unknown shape or a bad record gets. Every case builds data from generated
JSONL records with the embedded byte-level tokenizer (one token per byte) and checks the trained tokens."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from models.tokenizer import EOS_TOKEN, embedded_tokenizer
from tests.conftest import compose_config, generated_sft_records
from trainer.config import schema as C
from trainer.config.schema import DataConfig, MixtureSource, TesseraConfig
from trainer.data import sft, sources, tokenizing
from trainer.data.datasets import IGNORE, build_data
from tessera.errors import DataError

VOCAB = 264  # the embedded tokenizer's 258 tokens, padded as the presets do
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# The template Tessera installs for a tokenizer without one, as it was before tools (plain conversations must
# render exactly as they did: the cached tokens of existing data stay the same).
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return embedded_tokenizer()


def _cfg(tmp_path, **data) -> TesseraConfig:
    cfg = TesseraConfig()
    data.setdefault("cache_dir", str(tmp_path / "cache"))
    data.setdefault("val_fraction", 0.0)
    data.setdefault("seq_len", 1024)
    cfg.data = DataConfig(kind="sft", **data)
    return cfg


def _write(tmp_path, name: str, records) -> str:
    path = Path(tmp_path) / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _examples(tmp_path, tok, name, records, **data) -> list:
    """(ids, labels) of each record, in record order, through build_data (the tokenization cache)."""
    seqs = build_data(_cfg(tmp_path, path=_write(tmp_path, name, records), **data), tok, VOCAB,
                      log=lambda m: None).train.base
    assert list(seqs.keep) == list(range(len(records)))
    out = []
    for i in range(len(records)):
        n = int(seqs.offsets[i + 1] - seqs.offsets[i])
        batch = seqs.get([i])
        out.append((batch["input_ids"][0].numpy()[:n], batch["labels"][0].numpy()[:n]))
    return out


def _trained(tok, example) -> str:
    labels = example[1]
    return tok.decode(labels[labels != IGNORE])


def _text(tok, example) -> str:
    return tok.decode(example[0])


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (ids_a, labels_a), (ids_b, labels_b) in zip(a, b):
        np.testing.assert_array_equal(ids_a, ids_b)
        np.testing.assert_array_equal(labels_a, labels_b)


def _chat(n: int = 6):
    """Generated chat records (tests/conftest.py), each given a system turn."""
    _, chat = generated_sft_records(n=n, seed=3)
    return [{"messages": [{"role": "system", "content": f"You are helper {i}."}] + r["messages"]}
            for i, r in enumerate(chat)]


def _assistant_texts(record) -> str:
    return "".join(m["content"] + EOS_TOKEN for m in record["messages"] if m["role"] == "assistant")


# ---- messages: content as text or typed parts -------------------------------------------------------------

def _as_parts(text: str, rng: random.Random) -> list:
    cut = rng.randint(0, len(text))
    return [{"type": "text", "text": text[:cut]}, {"type": "text", "text": text[cut:]}]


def test_chat_messages_train_exactly_the_assistant_turns(tmp_path, tok):
    records = _chat()
    for record, ex in zip(records, _examples(tmp_path, tok, "chat.jsonl", records)):
        assert _trained(tok, ex) == _assistant_texts(record)


def test_typed_text_parts_equal_string_content(tmp_path, tok):
    records, rng = _chat(), random.Random(0)
    parts = [{"messages": [dict(m, content=_as_parts(m["content"], rng)) for m in r["messages"]]} for r in records]
    _same(_examples(tmp_path, tok, "parts.jsonl", parts), _examples(tmp_path, tok, "chat.jsonl", records))


def test_a_non_text_part_names_record_message_and_type(tmp_path, tok):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    records = _chat(2)
    records[1]["messages"][1]["content"] = [{"type": "text", "text": "What is this?"}, image]
    with pytest.raises(DataError) as info:
        _examples(tmp_path, tok, "image.jsonl", records)
    assert "record 1 message 1: content part 1 is of type 'image_url'; only text parts can be trained on" in \
        str(info.value)


def test_null_content_only_beside_tool_calls(tmp_path, tok):
    records = _chat(2)
    records[0]["messages"][2]["content"] = None  # the first assistant turn, without tool calls
    with pytest.raises(DataError, match="record 0 message 2 needs 'content' text or a list of text parts"):
        _examples(tmp_path, tok, "null.jsonl", records)


# ---- ShareGPT ---------------------------------------------------------------------------------------------

SHAREGPT_ROLE = {"user": "human", "assistant": "gpt"}


def _sharegpt(record) -> dict:
    """The same conversation as ShareGPT: the system prompt as the top-level field, {from, value} turns."""
    system, *turns = record["messages"]
    return {"system": system["content"],
            "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in turns]}


def test_sharegpt_equals_the_same_conversation_as_messages(tmp_path, tok):
    records = _chat()
    shared = _examples(tmp_path, tok, "sharegpt.jsonl", [_sharegpt(r) for r in records])
    _same(shared, _examples(tmp_path, tok, "chat.jsonl", records))
    assert _trained(tok, shared[1]) == _assistant_texts(records[1])


def _tool_chat(tools=TOOLS, answer="Sunny in Paris.") -> dict:
    return {"tools": tools, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": CALL}]},
        {"role": "tool", "content": "sunny, 21 C"},
        {"role": "assistant", "content": answer}]}


def _llama_factory(answer="Sunny in Paris.") -> dict:
    """LLaMA-Factory's ShareGPT with tools: the schemas as a JSON string, function_call / observation turns."""
    return {"tools": json.dumps(TOOLS), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps(CALL)},
        {"from": "observation", "value": "sunny, 21 C"},
        {"from": "gpt", "value": answer}]}


def test_sharegpt_tools_and_function_calls_equal_messages_with_tool_calls(tmp_path, tok):
    shared = _examples(tmp_path, tok, "lf.jsonl", [_llama_factory(), _llama_factory("Warm.")])
    _same(shared, _examples(tmp_path, tok, "tools.jsonl", [_tool_chat(), _tool_chat(answer="Warm.")]))
    text = _text(tok, shared[0])
    assert text.startswith(f"<|tools|>\n{json.dumps(TOOLS)}\n<|user|>\nWeather in Paris?\n"), text
    assert "<|tool|>\nsunny, 21 C\n" in text
    # the tool-call turn is trained like any assistant turn; the tool's answer is not
    assert _trained(tok, shared[0]) == f"<|tool_call|>\n{json.dumps(CALL)}\n{EOS_TOKEN}Sunny in Paris.{EOS_TOKEN}"


def test_a_function_call_that_is_not_json_is_a_data_error(tmp_path, tok):
    record = _llama_factory()
    record["conversations"][1]["value"] = "get_weather(Paris)"
    with pytest.raises(DataError, match="record 0 message 1: a function_call turn's value must be JSON"):
        _examples(tmp_path, tok, "bad_call.jsonl", [record])


# ---- tools reach the template on every render ---------------------------------------------------------------

def test_tools_go_to_every_render_of_a_conversation(monkeypatch):
    t = embedded_tokenizer()
    sft.ensure_chat_template(t)
    calls, real = [], t.apply_chat_template

    def spy(messages, **kw):
        calls.append(kw.get("tools"))
        return real(messages, **kw)

    monkeypatch.setattr(t, "apply_chat_template", spy)
    conv = sources.conversation(_tool_chat(), 0, "test", sources.mapping_of(DataConfig(kind="sft")))
    ids, mask = sft.encode_conversation(t, conv.messages, conv.tools)
    assert len(calls) == 5 and all(c == TOOLS for c in calls)  # the whole, and prompt + turn of each response
    assert t.decode(ids).startswith(f"<|tools|>\n{json.dumps(TOOLS)}\n")


def test_the_default_template_renders_plain_conversations_as_before(tok):
    t = embedded_tokenizer()
    sft.ensure_chat_template(t)
    assert t.chat_template == sft.DEFAULT_CHAT_TEMPLATE
    opening = {"messages": [{"role": "assistant", "content": "Hi!"}, {"role": "tool", "content": "x"}]}
    for record in _chat(4) + [opening]:
        for gen in (False, True):
            assert t.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=gen) == \
                t.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=gen,
                                      chat_template=PLAIN_TEMPLATE)


# A tokenizer's own template that knows tools (set with data.chat_template): schemas in the system header, calls
# as <call>name(arguments)</call>.
TOOL_TEMPLATE = (
    "{% if tools %}[TOOLS]{% for t in tools %}{{ t['function']['name'] }};{% endfor %}[/TOOLS]{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}[A]{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<call>{{ c['function']['name'] }}({{ c['function']['arguments'] | tojson }})"
    "</call>{% endfor %}{{ eos_token }}"
    "{% else %}[{{ m['role'] | upper }}]{{ m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[A]{% endif %}"
)


def test_the_tokenizers_own_template_receives_tools_and_tool_calls(tmp_path):
    t = embedded_tokenizer()  # (its own: data.chat_template installs the template on it)
    ex, = _examples(tmp_path, t, "tools.jsonl", [_tool_chat()], chat_template=TOOL_TEMPLATE)
    assert _text(t, ex) == (f"[TOOLS]get_weather;[/TOOLS][USER]Weather in Paris?[A]<call>get_weather("
                            f'{{"city": "Paris"}})</call>{EOS_TOKEN}[TOOL]sunny, 21 C[A]Sunny in Paris.{EOS_TOKEN}')
    assert _trained(t, ex) == f'<call>get_weather({{"city": "Paris"}})</call>{EOS_TOKEN}Sunny in Paris.{EOS_TOKEN}'


def test_parquet_tool_records_equal_jsonl(tmp_path, tok):
    """Arrow gives every record the union of all records' fields (null where one has none): nulls inside tools and
    tool calls are dropped, so parquet trains the same tokens as JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    other = dict(_tool_chat(answer="Warm."), tools=[{"type": "function", "function": {"name": "now"}}])
    other["messages"][1]["tool_calls"][0]["function"] = {"name": "now", "arguments": {"tz": "UTC"}}
    records = [_tool_chat(), other]
    pq.write_table(pa.Table.from_pylist(records), str(tmp_path / "tools.parquet"))
    seqs = build_data(_cfg(tmp_path, path=str(tmp_path / "tools.parquet")), tok, VOCAB, log=lambda m: None)
    jsonl = _examples(tmp_path, tok, "tools.jsonl", records)
    for i, (ids, _) in enumerate(jsonl):
        np.testing.assert_array_equal(seqs.train.base.get([i])["input_ids"][0].numpy()[:len(ids)], ids)


# ---- loss weights ---------------------------------------------------------------------------------------------

def test_weight_zero_turns_are_not_trained(tmp_path, tok):
    records = _chat(4)
    odd = [r for r in records if sum(m["role"] == "assistant" for m in r["messages"]) == 2]
    assert odd
    weighted = json.loads(json.dumps(odd))
    for k, r in enumerate(weighted):
        first = next(m for m in r["messages"] if m["role"] == "assistant")
        first.update({"weight": 0} if k % 2 == 0 else {"train": False})  # axolotl spells it `train`
        r["messages"][0]["weight"] = 0  # (0 on a system turn changes nothing)
    plain = _examples(tmp_path, tok, "plain.jsonl", odd)
    for record, ex, base in zip(odd, _examples(tmp_path, tok, "weighted.jsonl", weighted), plain):
        last = [m["content"] for m in record["messages"] if m["role"] == "assistant"][-1]
        assert _trained(tok, ex) == last + EOS_TOKEN
        np.testing.assert_array_equal(ex[0], base[0])  # the same tokens, fewer targets


def test_bad_weights_are_data_errors(tmp_path, tok):
    cases = [({"weight": 0.5}, 2, "record 0 message 2: weight=0.5 must be 0 or 1 (true/false)"),
             ({"weight": 1}, 1, "record 0 message 1: weight=1 on a 'user' message: only assistant turns can be "
                                "trained on"),
             ({"weight": 0}, 2, "record 0 has no assistant message to learn from (every assistant turn has weight 0)")]
    for k, (extra, at, message) in enumerate(cases):
        record = _chat(1)[0]  # system, user, assistant
        record["messages"][at].update(extra)
        with pytest.raises(DataError) as info:
            _examples(tmp_path, tok, f"w{k}.jsonl", [record])
        assert message in str(info.value)


# ---- data.columns and data.roles ------------------------------------------------------------------------------

def test_column_and_role_mapping_equals_the_native_names(tmp_path, tok):
    records = _chat()
    role = {"system": "sys", "user": "person", "assistant": "bot"}
    mine = [{"dialog": [{"speaker": role[m["role"]], "text": m["content"]} for m in r["messages"]]} for r in records]
    columns, roles = {"messages": "dialog", "role": "speaker", "content": "text"}, {"bot": "assistant",
                                                                                    "person": "user", "sys": "system"}
    mapped = _examples(tmp_path, tok, "mine.jsonl", mine, columns=columns, roles=roles)
    _same(mapped, _examples(tmp_path, tok, "chat.jsonl", records))
    d = _cfg(tmp_path, path=str(tmp_path / "mine.jsonl"), columns=columns, roles=roles).data
    assert '"columns": {"content": "text", "messages": "dialog", "role": "speaker"}' in sources.describe_source(d)
    assert '"columns"' not in sources.describe_source(_cfg(tmp_path, path=str(tmp_path / "chat.jsonl")).data)


def test_alpaca_fields_by_other_names(tmp_path, tok):
    alpaca, _ = generated_sft_records(n=6, seed=5)
    native = [dict(r, system="Be brief.") for r in alpaca]
    mine = [{"question": r["instruction"], "context": r["input"], "answer": r["output"], "sys": "Be brief."}
            for r in alpaca]
    columns = {"instruction": "question", "input": "context", "output": "answer", "system": "sys"}
    mapped = _examples(tmp_path, tok, "mine.jsonl", mine, columns=columns)
    _same(mapped, _examples(tmp_path, tok, "alpaca.jsonl", native))
    assert _trained(tok, mapped[0]) == alpaca[0]["output"] + EOS_TOKEN


def test_unknown_shape_lists_the_fields_and_the_mapping_to_set(tmp_path, tok):
    with pytest.raises(DataError) as info:
        _examples(tmp_path, tok, "qa.jsonl", [{"question": "q", "answer": "a", "id": 1}])
    message = str(info.value)
    assert "SFT records need 'messages' (chat), 'conversations' (ShareGPT) or 'instruction' and 'output'" in message
    assert "found fields: answer, id, question;" in message
    assert "data.columns={messages: <field>}" in message and "data.columns={instruction: <field>, output: <field>}" \
        in message
    with pytest.raises(DataError, match=r"data.columns.messages='dialog', but the records have no such field "
                                        r"\(fields: answer, question\)"):
        _examples(tmp_path, tok, "qa2.jsonl", [{"question": "q", "answer": "a"}], columns={"messages": "dialog"})
    with pytest.raises(DataError, match=r"need 'dialog' \(data.columns.messages\)"):  # (a record of no shape)
        sources.conversation({"question": "q"}, 0, "test", sources.Mapping({"messages": "dialog"}, {}))


def test_mapping_config_problems():
    cfg = TesseraConfig()
    cfg.data = DataConfig(kind="sft", path="x.jsonl", columns={"messages": "dialog", "dialogue": "d", "text": "t"},
                          roles={"bot": "robot", "person": "user"})
    problems = C.validate(cfg, 1)
    assert f"data.columns has unknown key(s) dialogue, text; allowed: {', '.join(sources.COLUMN_KEYS)} " \
           f"(Tessera's field name -> your records')" in problems
    assert "data.roles.bot='robot' is not one of system, user, assistant, tool (your role name -> Tessera's)" \
        in problems
    cfg.data = DataConfig(kind="text", path="x.jsonl", columns={"messages": "dialog"})
    assert "data.columns and data.roles are read with kind=sft or preference only (data.kind=text)" in C.validate(cfg, 1)
    cfg.data = DataConfig(kind="mixture", sources=[MixtureSource(name="a", kind="sft", path="x.jsonl",
                                                                 columns={"prompt": "p", "bogus": "b"})])
    assert any(p.startswith("data.sources[0].columns has unknown key(s) bogus;") for p in C.validate(cfg, 1))


def test_columns_and_roles_compose_from_the_command_line():
    cfg = compose_config(["data=sft", "data.path=x.jsonl", "data.columns={messages: dialog, role: speaker}",
                          "data.roles={bot: assistant}"])
    assert cfg.data.columns == {"messages": "dialog", "role": "speaker"} and cfg.data.roles == {"bot": "assistant"}
    assert not [p for p in C.validate(cfg, 1) if "columns" in p or "roles" in p]


def test_a_mixture_source_carries_its_columns(tmp_path, tok):
    records = _chat(4)
    mine = [{"dialog": r["messages"]} for r in records]
    path = _write(tmp_path, "mine.jsonl", mine)
    cfg = TesseraConfig()
    cfg.data = DataConfig(kind="mixture", seq_len=1024, val_fraction=0.0, cache_dir=str(tmp_path / "cache"),
                          sources=[MixtureSource(name="chat", kind="sft", path=path, columns={"messages": "dialog"},
                                                 weight=1.0)])
    assert not [p for p in C.validate(cfg, 1) if p.startswith("data.")]
    data = build_data(cfg, tok, VOCAB, log=lambda m: None)
    assert "sft data: 4 documents" in data.description


# ---- python -m trainer.tokenize reads records the same way ------------------------------------------------------

def test_token_store_shards_normalise_records_as_the_cache_does(tmp_path, tok):
    records = [_llama_factory(), _llama_factory("Warm.")]
    cached = _examples(tmp_path, tok, "lf.jsonl", records)
    t = embedded_tokenizer()
    src = tokenizing.open_source(DataConfig(kind="sft", path=str(tmp_path / "lf.jsonl")), t)
    shard = list(tokenizing.shard_items({"records": [0, 2]}, src))
    for (ids, mask, ends), (cached_ids, cached_labels) in zip(shard, cached):
        np.testing.assert_array_equal(ids, cached_ids)
        np.testing.assert_array_equal(np.where(mask[1:] == 1, ids[1:], IGNORE), cached_labels[:-1])
        assert ends
