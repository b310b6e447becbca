"""Where records come from: the embedded corpus, local text / JSONL / parquet files (through `datasets`), or
a hub dataset by name. Every failure becomes a DataError naming the file or field."""
from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

from tessera.errors import DataError, one_line
from trainer.data.text_files import COMPRESSIONS, Piece, read_documents, text_pieces

CHAT_KINDS = ("sft", "preference")  # data kinds whose records are rendered with the chat template

# Plain text and JSON / JSONL records, also compressed as corpora ship (.txt.gz, .jsonl.zst): decompressed as they are
# read (text: trainer/data/text_files.py; records: `datasets`, streaming too).
TEXT_EXTS = tuple(ext + c for ext in (".txt", ".text", ".md") for c in ("",) + COMPRESSIONS)
JSON_EXTS = tuple(ext + c for ext in (".json", ".jsonl") for c in ("",) + COMPRESSIONS)
PARQUET_EXTS = (".parquet",)
SUPPORTED = TEXT_EXTS + JSON_EXTS + PARQUET_EXTS
SUPPORTED_IN_WORDS = f".txt, .text, .md, .json, .jsonl (also {', '.join(COMPRESSIONS)}), .parquet"


def resolve_files(path_spec: str) -> List[str]:
    """A file, a folder (searched recursively) or a glob; several separated by commas."""
    files: List[str] = []
    for part in [p.strip() for p in path_spec.split(",") if p.strip()]:
        part = os.path.expanduser(part)
        if os.path.isdir(part):
            found = sorted(f for f in glob.glob(os.path.join(part, "**", "*"), recursive=True)
                           if os.path.isfile(f) and f.endswith(SUPPORTED))
            if not found:
                raise DataError(f"data.path={part!r}: the folder holds no {SUPPORTED_IN_WORDS} files")
            files += found
        elif any(ch in part for ch in "*?["):
            found = sorted(f for f in glob.glob(part, recursive=True) if os.path.isfile(f))
            if not found:
                raise DataError(f"data.path={part!r}: the pattern matches no files")
            files += found
        elif os.path.isfile(part):
            files.append(part)
        else:
            raise DataError(f"data.path={part!r}: no such file or folder")
    for f in files:
        if not f.endswith(SUPPORTED):
            raise DataError(f"data.path: {f!r} has an unsupported extension (supported: {SUPPORTED_IN_WORDS})")
        if not os.access(f, os.R_OK):
            raise DataError(f"data.path: {f!r} is not readable")
        if os.path.getsize(f) == 0:
            raise DataError(f"data.path: {f!r} is empty")
    kinds = {file_kind(f) for f in files}
    if len(kinds) > 1:
        raise DataError(f"data.path mixes file types ({', '.join(sorted(kinds))}); use one type per run")
    return files


def file_kind(f: str) -> str:
    if f.endswith(TEXT_EXTS):
        return "text"
    if f.endswith(JSON_EXTS):
        return "json"
    return "parquet"


def files_fingerprint(files: List[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def load_local(files: List[str], streaming: bool = False):
    import datasets

    kind = file_kind(files[0])
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()  # failures become one DataError below
    try:
        # JSON(L) or parquet records; streaming: an IterableDataset, one shard per file
        return datasets.load_dataset(kind, data_files=files, split="train", streaming=streaming)
    except Exception as e:  # noqa: BLE001 - datasets raises many types; the user needs one line
        raise DataError(f"data.path: cannot read {', '.join(files[:3])}{' ...' if len(files) > 3 else ''}: "
                        f"{_reason(e)}") from None


def _reason(e: BaseException) -> str:
    """The line of an exception chain that says where: datasets falls back to pandas when pyarrow fails on a
    JSON file, and pandas' error ("Expected object or value") hides pyarrow's ("... changed from string to number
    in row 3")."""
    lines = [one_line(link) for link in _exception_chain(e)]
    return next((line for line in lines if " row " in line), one_line(e.__cause__ or e))


def _exception_chain(e: BaseException, most: int = 8) -> Iterator[BaseException]:
    """`e`, then what caused it or was being handled when it was raised, and so on."""
    link = e.__cause__ or e.__context__
    yield e
    while link is not None and most > 1:
        yield link
        link, most = link.__cause__ or link.__context__, most - 1


def load_hub(name: str, config_name, split: str, revision, local: str = "data=text data.path=<a local copy>",
             streaming: bool = False):
    """A hub dataset by name (streaming: an IterableDataset read as it is iterated); a failure (no hub access, an
    unknown name or split) names it and the local alternative `local`."""
    import datasets

    try:
        return datasets.load_dataset(name, config_name, split=split, revision=revision, streaming=streaming)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"data.name={name!r}: cannot load the hub dataset (split {split!r}): "
                        f"{one_line(e).rstrip('.')}; without hub access, train on a local copy with {local}") from None


def reads_hub(data_cfg) -> bool:
    """data.kind=hub, or SFT / preference records from the hub: data.name and no data.path (a path wins)."""
    return data_cfg.kind == "hub" or (data_cfg.kind in CHAT_KINDS and not data_cfg.path and bool(data_cfg.name))


def _require_column(ds, field: str, key: str, where: str):
    if field not in ds.column_names:
        raise DataError(f"{where}: records have no {field!r} field (fields: {', '.join(ds.column_names)}); "
                        f"set {key}")


def iter_texts(data_cfg, embedded_fn=None) -> Iterator[Piece]:
    """Plain-text documents for packing, as pieces of at most data.max_document_chars (trainer/data/text_files.py):
    embedded, plain-text files (streamed, documents cut at data.document_separator), JSONL/parquet
    (`data.text_field`), or hub."""
    cap = data_cfg.max_document_chars
    if data_cfg.kind == "embedded":
        for text in embedded_fn():
            yield from text_pieces(text, cap)
        return
    if data_cfg.kind != "hub":
        files = resolve_files(data_cfg.path)
        if file_kind(files[0]) == "text":
            yield from _text_file_documents(files, data_cfg)
            return
    for text in _record_texts(data_cfg):
        yield from text_pieces(text, cap)


def _text_file_documents(files: List[str], data_cfg) -> Iterator[Piece]:
    """The documents of plain-text files, in order, up to data.max_records of them."""
    count, limit = 0, data_cfg.max_records
    for f in files:
        for piece in read_documents(f, data_cfg.document_separator, data_cfg.max_document_chars):
            if limit is not None and count >= limit:
                return
            yield piece
            count += piece.ends


@dataclass
class Records:
    """A source of records (JSONL/parquet files or a hub dataset, read through `datasets`): random access by index,
    so a range of them is one shard of `python -m trainer.tokenize`."""

    ds: object
    where: str  # names the source in messages
    form: str  # the text field (text records), or "alpaca" / "chat" / "sharegpt" (SFT: the shape found first)
    limit: int  # records used: all, or data.max_records
    mapping: Optional["Mapping"] = None  # SFT: data.columns and data.roles

    def __len__(self):
        return self.limit

    def rows(self, records: Optional[range] = None) -> Iterator[Tuple[int, dict]]:
        records = range(self.limit) if records is None else records
        if len(records):
            for i, rec in zip(records, self.ds.select(records)):
                yield i, rec


def dataset_of(data_cfg, local: str):
    if reads_hub(data_cfg):
        return load_hub(data_cfg.name, data_cfg.config_name, data_cfg.split, data_cfg.revision, local=local), \
            f"data.name={data_cfg.name!r}"
    files = resolve_files(data_cfg.path)
    if data_cfg.kind in CHAT_KINDS and file_kind(files[0]) == "text":
        raise DataError(f"data.path={data_cfg.path!r}: {data_cfg.kind} data must be JSON, JSONL or parquet records")
    return load_local(files), f"data.path={data_cfg.path!r}"


def limited(ds, data_cfg) -> int:
    return len(ds) if data_cfg.max_records is None else min(len(ds), data_cfg.max_records)


def text_records(data_cfg) -> Records:
    """JSONL/parquet records or a hub dataset whose field data.text_field holds the text."""
    ds, where = dataset_of(data_cfg, "data=text data.path=<a local copy>")
    field = "text" if "text" in ds.column_names and data_cfg.text_field == "text" else data_cfg.text_field
    _require_column(ds, field, "data.text_field", where)
    return Records(ds, where, field, limited(ds, data_cfg))


def record_texts(src: Records, records: Optional[range] = None) -> Iterator[str]:
    """The non-empty texts of `records` (all by default), each checked."""
    for i, rec in src.rows(records):
        value = rec[src.form]
        if value is None:
            raise DataError(f"{src.where}: record {i} has no value in field {src.form!r}")
        if not isinstance(value, str):
            raise DataError(f"{src.where}: record {i} field {src.form!r} is {type(value).__name__}, not text")
        if value:
            yield value


def _record_texts(data_cfg) -> Iterator[str]:
    """The text field of JSONL/parquet records or of a hub dataset."""
    yield from record_texts(text_records(data_cfg))


# ---- SFT records: the shapes users have, normalised to one conversation ------------------------------------
# data.columns: Tessera's field name -> the record's (docs/data.md, "Chat data shapes"). prompt, chosen and rejected
# are preference data's (accepted now, read by data=sft nowhere).
COLUMN_KEYS = ("messages", "conversations", "role", "content", "weight", "system", "tools", "instruction", "input",
               "output", "prompt", "chosen", "rejected")
ROLE_NAMES = ("system", "user", "assistant", "tool")  # what data.roles maps a record's role names to
# ShareGPT (`conversations` of {from, value}) role names; data.roles adds to them and wins.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system", "function_call": "assistant", "observation": "tool",
                  "tool": "tool", "function": "tool"}
TEXT_PART_JOINER = ""  # typed content parts [{type: text, text}, ...] are concatenated, as HF chat templates do


@dataclass(frozen=True)
class Mapping:
    """data.columns (Tessera's field name -> the record's) and data.roles (a record's role name -> Tessera's)."""

    columns: dict
    roles: dict

    def field(self, name: str) -> str:
        return self.columns.get(name, name)

    def named(self, name: str) -> str:
        """A field for messages: 'dialog' (data.columns.messages) where mapped, else 'messages'."""
        return f"{self.field(name)!r} (data.columns.{name})" if name in self.columns else repr(name)


def mapping_of(data_cfg) -> Mapping:
    return Mapping(dict(data_cfg.columns or {}), dict(data_cfg.roles or {}))


@dataclass
class Conversation:
    """A record as the chat template gets it: messages [{role, content, tool_calls?, name?, tool_call_id?,
    train}] (train: the turn is learned from) and the tool schemas, or None."""

    messages: list
    tools: Optional[list] = None


def sft_records(data_cfg) -> Records:
    """SFT records from data.path, or from the hub dataset data.name where data.path is not set."""
    ds, where = dataset_of(data_cfg, "data.path=<a local copy of the records>")
    cols, m = set(ds.column_names), mapping_of(data_cfg)
    for name in ("messages", "conversations", "instruction", "output"):
        if name in m.columns and m.field(name) not in cols:  # named by the user: said, not guessed around
            raise DataError(f"{where}: data.columns.{name}={m.field(name)!r}, but the records have no such field "
                            f"(fields: {', '.join(sorted(cols))})")
    if m.field("messages") in cols:
        form = "chat"
    elif m.field("conversations") in cols:
        form = "sharegpt"
    elif {m.field("instruction"), m.field("output")} <= cols:
        form = "alpaca"
    else:
        raise DataError(f"{where}: {_shape_hint(m, cols)}")
    return Records(ds, where, form, limited(ds, data_cfg), m)


def _shape_hint(m: Mapping, fields) -> str:
    return (f"SFT records need {m.named('messages')} (chat), {m.named('conversations')} (ShareGPT) or "
            f"{m.named('instruction')} and {m.named('output')} (alpaca-style); found fields: "
            f"{', '.join(sorted(fields)) or 'none'}; where yours go by other names, map them: "
            f"data.columns={{messages: <field>}}, data.columns={{conversations: <field>}} or "
            f"data.columns={{instruction: <field>, output: <field>}} (docs/data.md, Chat data shapes)")


def iter_sft_records(data_cfg) -> Iterator[Tuple[int, Conversation]]:
    """The conversation of each record (sft_messages)."""
    yield from sft_messages(sft_records(data_cfg))


def sft_messages(src: Records, records: Optional[range] = None) -> Iterator[Tuple[int, Conversation]]:
    """The conversation of each of `records` (all by default): `conversation` below, for the cache and for
    python -m trainer.tokenize alike."""
    mapping = src.mapping or Mapping({}, {})
    for i, rec in src.rows(records):
        yield i, conversation(rec, i, src.where, mapping)


def conversation(rec: dict, i: int, where: str, mapping: Mapping) -> Conversation:
    """One record of any shape -> a Conversation: chat `messages` [{role, content}] (content text or typed parts),
    ShareGPT `conversations` [{from, value}] (plus `system`), or alpaca-style {instruction, input?, output,
    system?}; `tools` on any of them. Each shape is found by its field (data.columns names them)."""
    f = mapping.field
    if rec.get(f("messages")) is not None:
        messages = turns(rec[f("messages")], i, where, mapping, sharegpt=False)
    elif rec.get(f("conversations")) is not None:
        messages = system_turn(rec, mapping) + turns(rec[f("conversations")], i, where, mapping, sharegpt=True)
    elif f("instruction") in rec or f("output") in rec:
        messages = _alpaca_messages(rec, i, where, mapping)
    elif f("messages") in rec or f("conversations") in rec:
        name = "messages" if f("messages") in rec else "conversations"
        raise DataError(f"{where}: record {i} has no {f(name)!r} list")
    else:
        raise DataError(f"{where}: record {i}: {_shape_hint(mapping, rec)}")
    if not any(m["train"] for m in messages):
        weighted = any(m["role"] == "assistant" for m in messages)
        raise DataError(f"{where}: record {i} has no assistant message to learn from"
                        + (" (every assistant turn has weight 0)" if weighted else ""))
    return Conversation(messages, tools_of(rec.get(f("tools")), i, where, f("tools")))


def system_turn(rec: dict, mapping: Mapping) -> list:
    system = rec.get(mapping.field("system"))
    return [{"role": "system", "content": system, "train": False}] if isinstance(system, str) and system else []


def _alpaca_messages(rec: dict, i: int, where: str, mapping: Mapping) -> list:
    f = mapping.field
    instr, out = rec.get(f("instruction")), rec.get(f("output"))
    if not isinstance(instr, str) or not isinstance(out, str) or not out:
        raise DataError(f"{where}: record {i} needs text in {f('instruction')!r} and a non-empty {f('output')!r}")
    extra = rec.get(f("input")) or ""
    user = instr if not extra else f"{instr}\n\n{extra}"
    messages = [{"role": "user", "content": user, "train": False},
                {"role": "assistant", "content": out, "train": True}]
    return system_turn(rec, mapping) + messages


def turns(items, i: int, where: str, mapping: Mapping, sharegpt: bool) -> list:
    """A record's list of messages (chat or ShareGPT), each normalised by _turn."""
    name = mapping.field("conversations" if sharegpt else "messages")
    if not isinstance(items, list) or not items:
        raise DataError(f"{where}: record {i} has no {name!r} list")
    roles = dict(SHAREGPT_ROLES, **mapping.roles) if sharegpt else mapping.roles
    keys = (mapping.columns.get("role", "from" if sharegpt else "role"),
            mapping.columns.get("content", "value" if sharegpt else "content"))
    return [_turn(m, f"{where}: record {i} message {j}", keys, roles, mapping, sharegpt) for j, m in enumerate(items)]


def _turn(m, at: str, keys: Tuple[str, str], roles: dict, mapping: Mapping, sharegpt: bool) -> dict:
    """One message, normalised: {role, content (text), tool_calls?, name?, tool_call_id?, train}."""
    role_key, content_key = keys
    if not isinstance(m, dict) or not isinstance(m.get(role_key), str):
        raise DataError(f"{at} needs {role_key!r} and {content_key!r} text")
    raw = m[role_key]
    role = roles.get(raw, raw)
    out = {"role": role}
    calls = m.get("tool_calls")
    if sharegpt and raw == "function_call" and raw not in mapping.roles:
        calls = _function_call(m.get(content_key), at)
        out["content"] = ""
    else:
        out["content"] = _content(m.get(content_key), at, content_key, calls is not None and role == "assistant")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise DataError(f"{at}: 'tool_calls' must be a list of calls, on an assistant message (role {role!r})")
        out["tool_calls"] = _without_nulls(calls)
    if role == "tool":
        out.update({k: m[k] for k in ("name", "tool_call_id") if m.get(k) is not None})
    out["train"] = _trained(m, at, role, mapping.field("weight"))
    return out


def _content(value, at: str, key: str, tool_calls: bool) -> str:
    """Text, or typed parts [{type: text, text}, ...] joined by TEXT_PART_JOINER; null only beside tool calls."""
    if isinstance(value, str):
        return value
    if value is None and tool_calls:
        return ""  # rendered as empty text (templates concatenate content; null would print or fail)
    if not isinstance(value, list):
        raise DataError(f"{at} needs {key!r} text or a list of text parts (got {type(value).__name__})")
    texts = []
    for k, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"of type {kind!r}" if kind not in (None, "text") else "not a {type: text, text: ...} part"
            raise DataError(f"{at}: content part {k} is {what}; only text parts can be trained on (drop the part, "
                            f"or the record)")
        texts.append(part["text"])
    return TEXT_PART_JOINER.join(texts)


def _trained(m: dict, at: str, role: str, weight_key: str) -> bool:
    """A turn's loss weight, `weight_key` (default 'weight') or axolotl's `train`: 0 or 1 (false/true); by default
    assistant turns are trained, the others not. Weight 1 elsewhere is refused: only assistant spans are masked."""
    key = weight_key if m.get(weight_key) is not None else "train"
    value = m.get(key)
    if value is None:
        return role == "assistant"
    if not isinstance(value, (bool, int, float)) or value not in (0, 1):
        raise DataError(f"{at}: {key}={value!r} must be 0 or 1 (true/false): 0 leaves an assistant turn untrained")
    if value and role != "assistant":
        raise DataError(f"{at}: {key}={value!r} on a {role!r} message: only assistant turns can be trained on (loss "
                        f"is masked to assistant spans); drop the {key!r} or set it to 0")
    return bool(value)


def _function_call(value, at: str) -> list:
    """A ShareGPT function_call turn's value, JSON {name, arguments} (or a list of them) -> tool_calls."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        calls = None
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls or not all(isinstance(c, dict) and "name" in c for c in calls):
        raise DataError(f'{at}: a function_call turn\'s value must be JSON {{"name": ..., "arguments": ...}} '
                        f"(or a list of them)")
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
            for c in calls]


def tools_of(value, i: int, where: str, key: str) -> Optional[list]:
    """The record's tool schemas: a list of JSON-schema descriptions (one dict is a list of one), or a JSON string
    of one; none (null, "", []) is None."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except ValueError as e:
            raise DataError(f"{where}: record {i} field {key!r} is not JSON ({one_line(e)})") from None
    value = [value] if isinstance(value, dict) else value
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{where}: record {i} field {key!r} must be a list of tool schemas (JSON objects), or a "
                        f"JSON string of one")
    return _without_nulls(value)


def _without_nulls(value):
    """Nested dicts without their null values: parquet and hub datasets give every record the union of the fields
    all records have, null where one has none."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def mapping_problems(d) -> List[str]:
    """data.columns / data.roles (and a mixture source's): known keys, Tessera's role names, kind=sft only."""
    entries = [("data", d.kind, d.columns, d.roles)]
    entries += [(f"data.sources[{i}]", s.kind, s.columns, s.roles) for i, s in enumerate(d.sources or [])]
    problems = []
    for key, kind, columns, roles in entries:
        columns, roles = dict(columns or {}), dict(roles or {})
        unknown = sorted(set(columns) - set(COLUMN_KEYS))
        if unknown:
            problems.append(f"{key}.columns has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(COLUMN_KEYS)} "
                            f"(Tessera's field name -> your records')")
        problems += [f"{key}.columns.{k} is empty; name the records' field" for k, v in columns.items() if not v]
        problems += [f"{key}.roles.{k}={v!r} is not one of {', '.join(ROLE_NAMES)} (your role name -> Tessera's)"
                     for k, v in roles.items() if v not in ROLE_NAMES]
        if (columns or roles) and kind not in CHAT_KINDS:
            problems.append(f"{key}.columns and {key}.roles are read with kind=sft or preference only "
                            f"({key}.kind={kind})"
                            + ("; a mixture's SFT sources carry their own: data.sources[i].columns"
                               if kind == "mixture" else ""))
    return problems


def describe_source(data_cfg) -> str:
    """A stable identity of the raw data, for the tokenization cache key."""
    if data_cfg.kind == "embedded":
        return json.dumps({"embedded": data_cfg.embedded_documents})
    if reads_hub(data_cfg):
        return json.dumps(_with_mapping({"hub": data_cfg.name, "config": data_cfg.config_name,
                                         "split": data_cfg.split, "revision": data_cfg.revision,
                                         "field": data_cfg.text_field, "max_records": data_cfg.max_records},
                                        data_cfg))
    files = resolve_files(data_cfg.path)
    source = {"files": files_fingerprint(files), "field": data_cfg.text_field, "max_records": data_cfg.max_records}
    if data_cfg.max_document_chars != 100_000:  # (the default adds nothing: existing cache entries stay valid)
        source["max_document_chars"] = data_cfg.max_document_chars
    if file_kind(files[0]) == "text":  # documents cut at the separator (one per file before)
        source["documents"] = "separator" if data_cfg.document_separator is None else data_cfg.document_separator
    return json.dumps(_with_mapping(source, data_cfg))


def _with_mapping(source: dict, data_cfg) -> dict:
    """data.columns and data.roles, where set (unset adds nothing: existing cache entries stay valid)."""
    for key in ("columns", "roles"):
        value = getattr(data_cfg, key, None)
        if value:
            source[key] = dict(sorted(dict(value).items()))
    return source
