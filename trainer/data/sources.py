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
from trainer.data.text_files import Piece, read_documents, text_pieces

TEXT_EXTS = (".txt", ".text", ".md")
JSON_EXTS = (".json", ".jsonl")
PARQUET_EXTS = (".parquet",)
SUPPORTED = TEXT_EXTS + JSON_EXTS + PARQUET_EXTS


def resolve_files(path_spec: str) -> List[str]:
    """A file, a folder (searched recursively) or a glob; several separated by commas."""
    files: List[str] = []
    for part in [p.strip() for p in path_spec.split(",") if p.strip()]:
        part = os.path.expanduser(part)
        if os.path.isdir(part):
            found = sorted(f for f in glob.glob(os.path.join(part, "**", "*"), recursive=True)
                           if os.path.isfile(f) and f.endswith(SUPPORTED))
            if not found:
                raise DataError(f"data.path={part!r}: the folder holds no {', '.join(SUPPORTED)} files")
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
            raise DataError(f"data.path: {f!r} has an unsupported extension (supported: {', '.join(SUPPORTED)})")
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
                        f"{one_line(e.__cause__ or e)}") from None


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
    """data.kind=hub, or SFT records from the hub: data=sft with data.name and no data.path (a path wins)."""
    return data_cfg.kind == "hub" or (data_cfg.kind == "sft" and not data_cfg.path and bool(data_cfg.name))


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
    form: str  # the text field (text records), or "alpaca" / "chat" (SFT)
    limit: int  # records used: all, or data.max_records

    def __len__(self):
        return self.limit

    def rows(self, records: Optional[range] = None) -> Iterator[Tuple[int, dict]]:
        records = range(self.limit) if records is None else records
        if len(records):
            for i, rec in zip(records, self.ds.select(records)):
                yield i, rec


def _dataset(data_cfg, local: str):
    if reads_hub(data_cfg):
        return load_hub(data_cfg.name, data_cfg.config_name, data_cfg.split, data_cfg.revision, local=local), \
            f"data.name={data_cfg.name!r}"
    files = resolve_files(data_cfg.path)
    if data_cfg.kind == "sft" and file_kind(files[0]) == "text":
        raise DataError(f"data.path={data_cfg.path!r}: SFT data must be JSON, JSONL or parquet records")
    return load_local(files), f"data.path={data_cfg.path!r}"


def _limited(ds, data_cfg) -> int:
    return len(ds) if data_cfg.max_records is None else min(len(ds), data_cfg.max_records)


def text_records(data_cfg) -> Records:
    """JSONL/parquet records or a hub dataset whose field data.text_field holds the text."""
    ds, where = _dataset(data_cfg, "data=text data.path=<a local copy>")
    field = "text" if "text" in ds.column_names and data_cfg.text_field == "text" else data_cfg.text_field
    _require_column(ds, field, "data.text_field", where)
    return Records(ds, where, field, _limited(ds, data_cfg))


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


def sft_records(data_cfg) -> Records:
    """SFT records from data.path, or from the hub dataset data.name where data.path is not set."""
    ds, where = _dataset(data_cfg, "data.path=<a local copy of the records>")
    cols = set(ds.column_names)
    if "messages" in cols:
        form = "chat"
    elif {"instruction", "output"} <= cols:
        form = "alpaca"
    else:
        raise DataError(f"{where}: SFT records need 'instruction' and 'output' (alpaca-style) or 'messages' "
                        f"(chat); found fields: {', '.join(sorted(cols))}")
    return Records(ds, where, form, _limited(ds, data_cfg))


def iter_sft_records(data_cfg) -> Iterator[Tuple[int, list]]:
    """Chat `messages` for each record (sft_messages)."""
    yield from sft_messages(sft_records(data_cfg))


def sft_messages(src: Records, records: Optional[range] = None) -> Iterator[Tuple[int, list]]:
    """Chat `messages` for each of `records`: alpaca-style {instruction, input?, output} becomes one user turn and
    one assistant turn; chat records carry `messages` [{role, content}]."""
    for i, rec in src.rows(records):
        yield i, (_alpaca_messages if src.form == "alpaca" else _chat_messages)(rec, i, src.where)


def _alpaca_messages(rec: dict, i: int, where: str) -> list:
    instr, out = rec.get("instruction"), rec.get("output")
    if not isinstance(instr, str) or not isinstance(out, str) or not out:
        raise DataError(f"{where}: record {i} needs text in 'instruction' and a non-empty 'output'")
    extra = rec.get("input") or ""
    user = instr if not extra else f"{instr}\n\n{extra}"
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": out}]
    if rec.get("system"):
        messages.insert(0, {"role": "system", "content": rec["system"]})
    return messages


def _chat_messages(rec: dict, i: int, where: str) -> list:
    messages = rec.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: record {i} has no 'messages' list")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: record {i} message {j} needs 'role' and 'content' text")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: record {i} has no assistant message to learn from")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def describe_source(data_cfg) -> str:
    """A stable identity of the raw data, for the tokenization cache key."""
    if data_cfg.kind == "embedded":
        return json.dumps({"embedded": data_cfg.embedded_documents})
    if reads_hub(data_cfg):
        return json.dumps({"hub": data_cfg.name, "config": data_cfg.config_name, "split": data_cfg.split,
                           "revision": data_cfg.revision, "field": data_cfg.text_field,
                           "max_records": data_cfg.max_records})
    files = resolve_files(data_cfg.path)
    source = {"files": files_fingerprint(files), "field": data_cfg.text_field, "max_records": data_cfg.max_records}
    if data_cfg.max_document_chars != 100_000:  # (the default adds nothing: existing cache entries stay valid)
        source["max_document_chars"] = data_cfg.max_document_chars
    if file_kind(files[0]) == "text":  # documents cut at the separator (one per file before)
        source["documents"] = "separator" if data_cfg.document_separator is None else data_cfg.document_separator
    return json.dumps(source)
