"""Plain-text files of any size, read in bounded pieces: a file is streamed in blocks of READ_BYTES, decoded
incrementally (UTF-8), and cut into documents at a separator (data.document_separator; null = one or more blank
lines). A document longer than data.max_document_chars comes out in pieces of at most that many characters (cut
at the last whitespace before the cap where there is one), which the tokenizer takes one at a time and the store
keeps as one document (no EOS between them). So memory holds one block and one piece at a time, whatever the size
of the file or of its documents. A compressed file (.gz, .bz2, .xz, .zst) is decompressed as it is read; it has no
byte offsets to start at, so it is read from its start, whole (one shard of a store or a stream)."""
from __future__ import annotations

import bz2
import codecs
import gzip
import lzma
import os
import re
from dataclasses import dataclass
from typing import Iterator, List, Optional

from tessera.errors import DataError, one_line

READ_BYTES = 1 << 20
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
# one or more blank (or whitespace-only) lines; ASCII whitespace only, so cuts found in bytes are the same
BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n[ \t\n\r\f\v]*")


@dataclass(frozen=True)
class Piece:
    """Text of one document, or a part of one: `ends` is False for every piece of a long document but its last."""

    text: str
    ends: bool = True


def _splitter(separator: Optional[str]):
    if separator is None:
        return BLANK_LINE
    if separator == "":
        raise DataError("data.document_separator='' is empty: null ends documents at blank lines")
    return re.compile(re.escape(separator))


def is_compressed(path: str) -> bool:
    return path.endswith(COMPRESSIONS)


def open_bytes(path: str):
    """The file's bytes, decompressed where its name says it is compressed."""
    if path.endswith(".zst"):
        import zstandard  # .zst files only

        return zstandard.open(path, "rb")
    opener = next((o for suffix, o in _OPENERS.items() if path.endswith(suffix)), None)
    return opener(path, "rb") if opener else open(path, "rb")


def _decoded_blocks(path: str, read_bytes: int, start: int = 0, end: Optional[int] = None) -> Iterator[str]:
    """Bytes [start, end) of the file (end None: to its end), decoded as UTF-8 block by block."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    with open_bytes(path) as fh:
        if start:
            fh.seek(start)
        left = float("inf") if end is None else end - start
        while True:
            block = fh.read(int(min(read_bytes, left)))
            left -= len(block)
            text = decoder.decode(block, final=not block)
            if text:
                yield text
            if not block:
                return


def _cut(text: str, cap: int) -> int:
    """Where a piece of a long document ends: the last whitespace within the cap, else the cap."""
    at = max(text.rfind(" ", 0, cap), text.rfind("\n", 0, cap))
    return at + 1 if at > 0 else cap


def read_documents(path: str, separator: Optional[str] = None, max_chars: int = 100_000,
                   read_bytes: int = READ_BYTES, start: int = 0, end: Optional[int] = None) -> Iterator[Piece]:
    """The documents of one text file, in file order, as pieces (see the module's docstring); with `start` and
    `end` (from document_starts) the documents of that byte range. Leading and trailing whitespace of a document
    is kept except at the separator itself; empty documents are skipped."""
    try:
        yield from _documents(path, _splitter(separator), max_chars, read_bytes, start, end)
    except UnicodeDecodeError as e:
        raise DataError(f"data.path: cannot read {path}: it is not UTF-8 text ({one_line(e)}){_named_plain(path)}") \
            from None
    except (OSError, EOFError, lzma.LZMAError) as e:  # a damaged or truncated compressed file
        raise DataError(f"data.path: cannot read {path}: {one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - zstandard's own error type (imported for .zst files only)
        if type(e).__name__ != "ZstdError":
            raise
        raise DataError(f"data.path: cannot read {path}: {one_line(e)}") from None


_MAGIC = {b"\x1f\x8b": ".gz", b"BZh": ".bz2", b"\xfd7zXZ\x00": ".xz", b"\x28\xb5\x2f\xfd": ".zst"}


def _named_plain(path: str) -> str:
    """A hint where a file named as plain text holds compressed bytes."""
    with open(path, "rb") as fh:
        head = fh.read(8)
    suffix = next((s for magic, s in _MAGIC.items() if head.startswith(magic)), None)
    return f"; it is {suffix[1:]}-compressed: name it {os.path.basename(path)}{suffix}" if suffix and \
        not is_compressed(path) else ""


def _documents(path: str, split, max_chars: int, read_bytes: int, start: int, end: Optional[int]) -> Iterator[Piece]:
    pending, started = "", False  # `started`: pieces of the current document were already given out
    for block in _decoded_blocks(path, read_bytes, start, end):
        pending += block
        parts, pending = _complete_documents(split, pending)
        for part in parts:
            yield from _pieces(part, max_chars, started)
            started = False
        while len(pending) > 2 * max_chars:  # a long document: give out its head, keep reading its tail
            n = _cut(pending, max_chars)
            yield Piece(pending[:n], ends=False)
            started, pending = True, pending[n:]
    for part in split.split(pending):
        yield from _pieces(part, max_chars, started)
        started = False


def _complete_documents(split, text: str):
    """(the documents of `text` that a separator ends, the rest). A separator that reaches the end of `text` may
    go on in the next block, so it is left for then: the cuts never depend on where a block ends."""
    parts, at = [], 0
    for m in split.finditer(text):
        if m.end() >= len(text):
            break
        parts.append(text[at:m.start()])
        at = m.end()
    return parts, text[at:]


def text_pieces(text: str, max_chars: int) -> Iterator[Piece]:
    """One document's text (a record's field, an embedded document) as pieces of at most max_chars."""
    yield from _pieces(text, max_chars, started=False)


def _pieces(text: str, max_chars: int, started: bool) -> Iterator[Piece]:
    """A document's (remaining) text as pieces of at most max_chars, the last one ending the document; `started`:
    earlier pieces of it were given out already."""
    while len(text) > max_chars:
        n = _cut(text, max_chars)
        yield Piece(text[:n], ends=False)
        text, started = text[n:], True
    if text.strip():
        yield Piece(text)
    elif started:  # a document that ended in whitespace after a cut: close it
        yield Piece("")


def document_starts(path: str, separator: Optional[str], every: int, read_bytes: int = READ_BYTES) -> List[int]:
    """Byte offsets that cut the file into ranges of whole documents of about `every` bytes: 0, then the first
    document start at or after each multiple of `every` (where read_documents would begin a document), then the
    file's size. Found on the bytes (separators are ASCII whitespace or the separator's UTF-8 bytes, which never
    occur inside another character), one block at a time."""
    split = _byte_splitter(separator)
    cuts, base, pending, size = [0], 0, b"", 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(read_bytes)
            size += len(block)
            pending += block
            at = 0
            for m in split.finditer(pending):
                if block and m.end() >= len(pending):
                    break  # may go on in the next block
                at = m.end()
                if base + at >= cuts[-1] + every and base + at < size:
                    cuts.append(base + at)
            if not block:
                break
            keep = max(at, len(pending) - 4 * read_bytes)  # a separator never spans more than what is kept
            base, pending = base + keep, pending[keep:]
    return cuts + [size] if size > cuts[-1] else cuts


def document_start_at(path: str, separator: Optional[str], offset: int, read_bytes: int = READ_BYTES) -> int:
    """The first document start at or after byte `offset` (the file's size if none), found by reading from a
    little before `offset` to the next separator only: consecutive byte ranges cut at document_start_at(a_i) hold
    whole documents, each in one range, without reading the file from its start (a separator run longer than the
    look-back may move a cut to the next document start; the ranges still cover every document once)."""
    if offset <= 0:
        return 0
    split = _byte_splitter(separator)
    base = max(0, offset - max(4096, 2 * len((separator or "").encode("utf-8"))))
    pending = b""
    with open(path, "rb") as fh:
        fh.seek(base)
        while True:
            block = fh.read(read_bytes)
            pending += block
            at = 0
            for m in split.finditer(pending):
                if block and m.end() >= len(pending):
                    break  # may go on in the next block
                at = m.end()
                if base + at >= offset:
                    return base + at
            if not block:
                return base + len(pending)
            keep = max(at, len(pending) - 4 * read_bytes)  # a separator never spans more than what is kept
            base, pending = base + keep, pending[keep:]


def _byte_splitter(separator: Optional[str]):
    if separator is None:
        return re.compile(BLANK_LINE.pattern.encode())
    return re.compile(re.escape(separator.encode("utf-8")))
