"""Reading a corpus: which files are accepted, how they split into documents, how bytes become text.

Accepted inputs: ``.txt``, ``.jsonl`` and their ``.gz`` variants. A JSONL line is one document (its
``--text-key`` field, or with ``--segments-key`` a list of ``{"text", "loss"}`` segments that mark
the scored spans); a ``.txt`` file is one document, or one per line (``--split line``) or per
blank-line-separated paragraph (``--split paragraph``). Reading yields raw byte records so the
expensive part (UTF-8 and JSON decoding) can run in worker processes; :func:`decode_document`
turns a record into text and :func:`decode_segments` into segments, counting what they skip or
repair.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from megabeta.data.errors import DataError

SPLIT_MODES = ("none", "line", "paragraph")
BAD_UTF8_POLICIES = ("replace", "skip", "error")
_KINDS = {".txt": "txt", ".jsonl": "jsonl"}


@dataclass(frozen=True)
class ReadOptions:
    """How input files become documents."""

    text_key: str = "text"
    """JSONL field that holds a document's text."""
    split: str = "none"
    """How a .txt file splits into documents: none (whole file), line, paragraph."""
    on_bad_utf8: str = "replace"
    """Documents with undecodable UTF-8: replace bad bytes by U+FFFD, skip them, or error."""
    segments_key: str | None = None
    """JSONL field holding a document as ``[{"text": str, "loss": bool}, ...]`` (None: plain
    text from ``text_key``)."""


@dataclass(frozen=True)
class InputFile:
    """One accepted input file."""

    path: Path
    kind: str
    """txt or jsonl"""
    compressed: bool
    size: int
    """Bytes on disk (compressed size for .gz)."""


def input_files(paths: list[str] | list[Path]) -> list[InputFile]:
    """Check every input up front (exists, a file, non-empty, known type); DataError if not."""
    if not paths:
        raise DataError("no input files; pass one or more files to --inputs")
    files = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise DataError(f"{path}: no such file; check the path given to --inputs")
        if path.is_dir():
            raise DataError(f"{path}: is a directory; pass the files in it (e.g. {path}/*.jsonl)")
        compressed = path.name.endswith(".gz")
        base = path.name[:-3] if compressed else path.name
        kind = next((kind for suffix, kind in _KINDS.items() if base.endswith(suffix)), None)
        if kind is None:
            raise DataError(f"{path}: unsupported file type; inputs must end in .txt, .jsonl, "
                            ".txt.gz or .jsonl.gz (rename it or convert it)")
        size = path.stat().st_size
        if size == 0:
            raise DataError(f"{path}: empty file; remove it from --inputs")
        files.append(InputFile(path, kind, compressed, size))
    return files


_READ_BUFFER = 1 << 20


class RecordReader:
    """Raw records of one input file, in chunks: the bytes of each document and the 1-based line
    where it starts. Line records keep their line ending (:func:`decode_document` drops it), so a
    chunk of lines is one ``readlines`` call: the reading process, which feeds the workers, does
    little per line."""

    def __init__(self, file: InputFile, split: str) -> None:
        self.file = file
        self.split = "line" if file.kind == "jsonl" else split
        self._raw: BinaryIO | None = None

    @property
    def position(self) -> int:
        """Bytes of the file on disk consumed so far (for progress)."""
        return self._raw.tell() if self._raw is not None else 0

    def chunks(self, chunk_bytes: int) -> Iterator[tuple[list[bytes], Sequence[int]]]:
        """``(records, start lines)`` of about ``chunk_bytes`` each, in file order."""
        found = False
        # A large buffer: readlines through the default 8 KiB one took twice as long.
        with open(self.file.path, "rb", buffering=_READ_BUFFER) as raw:
            self._raw = raw
            stream = gzip.GzipFile(fileobj=raw, mode="rb") if self.file.compressed else raw
            try:
                for chunk in self._chunks(stream, chunk_bytes):
                    found = True
                    yield chunk
            except (gzip.BadGzipFile, EOFError, zlib.error) as err:
                raise DataError(f"{self.file.path}: not a readable gzip file ({err}); re-compress "
                                "it or remove it from --inputs") from None
        if not found:
            raise DataError(f"{self.file.path}: contains no text; remove it from --inputs")

    def __iter__(self) -> Iterator[tuple[bytes, int]]:
        for records, lines in self.chunks(1 << 20):
            yield from zip(records, lines)

    def _chunks(self, stream: BinaryIO,
                chunk_bytes: int) -> Iterator[tuple[list[bytes], Sequence[int]]]:
        if self.split == "none":
            yield [stream.read()], [1]
        elif self.split == "line":
            first = 1
            while lines := stream.readlines(chunk_bytes):
                yield lines, range(first, first + len(lines))
                first += len(lines)
        else:
            records, starts, size = [], [], 0
            for record, start in _paragraphs(stream):
                records.append(record)
                starts.append(start)
                size += len(record)
                if size >= chunk_bytes:
                    yield records, starts
                    records, starts, size = [], [], 0
            if records:
                yield records, starts


def _paragraphs(stream: BinaryIO) -> Iterator[tuple[bytes, int]]:
    lines: list[bytes] = []
    start = 0
    for number, line in enumerate(stream, 1):
        if line in (b"\n", b"\r\n"):
            if lines:
                yield _strip_eol(b"".join(lines)), start
                lines = []
            continue
        if not lines:
            start = number
        lines.append(line)
    if lines:
        yield _strip_eol(b"".join(lines)), start


def _strip_eol(line: bytes) -> bytes:
    if line.endswith(b"\n"):
        line = line[:-1]
        if line.endswith(b"\r"):
            line = line[:-1]
    return line


@dataclass
class DocumentCounts:
    """What decoding kept, skipped and repaired; ``first_*`` locate the first case as FILE:LINE."""

    documents: int = 0
    empty: int = 0
    first_empty: str | None = None
    undecodable: int = 0
    first_undecodable: str | None = None

    def add(self, later: DocumentCounts) -> None:
        """Fold in the counts of input that comes after this one's."""
        self.documents += later.documents
        self.empty += later.empty
        self.first_empty = self.first_empty or later.first_empty
        self.undecodable += later.undecodable
        self.first_undecodable = self.first_undecodable or later.first_undecodable

    def as_report(self, policy: str) -> dict:
        return {"empty_documents_skipped": self.empty, "first_empty_document": self.first_empty,
                "undecodable_documents": self.undecodable, "undecodable_policy": policy,
                "first_undecodable_document": self.first_undecodable}


def decode_document(raw: bytes, file: InputFile, line: int, options: ReadOptions,
                    counts: DocumentCounts) -> str | None:
    """Text of one record, or None when it is skipped (and counted)."""
    if file.kind == "txt" and options.split == "line":
        raw = _strip_eol(raw)
    text = _utf8(raw, file, line, options, counts)
    if text is not None and file.kind == "jsonl":
        text = _json_text(text, file, line, options, counts)
    if text is None:
        return None
    if not text:
        return _empty(file, line, counts)
    counts.documents += 1
    return text


Segment = tuple[str, bool]
"""A piece of a segmented document: its text, and whether its tokens are scored targets."""


def decode_segments(raw: bytes, file: InputFile, line: int, options: ReadOptions,
                    counts: DocumentCounts) -> list[Segment] | None:
    """The ``options.segments_key`` segments of one JSONL record, or None when it is skipped (and
    counted): an empty document when no segment has text; undecodable UTF-8 as ``on_bad_utf8``
    says, for the whole document."""
    line_text = _utf8(raw, file, line, options, counts)
    if line_text is None:
        return None
    if not line_text.strip():
        return _empty(file, line, counts)
    segments = _json_segments(_json_record(line_text, file, line), file, line,
                              options.segments_key)
    if _SURROGATE_ESCAPE.search(line_text):
        for text, _ in segments:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                # The policy applies to the document once: error, skip, or replace in every
                # segment.
                if _bad_utf8(text.encode("utf-8", "surrogatepass"), err, file, line, options,
                             counts) is None:
                    return None
                segments = [(t.encode("utf-8", "surrogatepass").decode("utf-8", "replace"), loss)
                            for t, loss in segments]
                break
    if not any(text for text, _ in segments):
        return _empty(file, line, counts)
    counts.documents += 1
    return segments


def _utf8(raw: bytes, file: InputFile, line: int, options: ReadOptions,
          counts: DocumentCounts) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return _bad_utf8(raw, err, file, line, options, counts)


def _empty(file: InputFile, line: int, counts: DocumentCounts) -> None:
    counts.empty += 1
    counts.first_empty = counts.first_empty or f"{file.path}:{line}"
    return None


def _bad_utf8(raw: bytes, err: UnicodeError, file: InputFile, line: int, options: ReadOptions,
              counts: DocumentCounts) -> str | None:
    where = f"{file.path}:{line}"
    if options.on_bad_utf8 == "error":
        raise DataError(f"{where}: invalid UTF-8 ({err.reason} at byte {err.start} of the "
                        "document); fix the file, or pass --on-bad-utf8 replace or skip")
    counts.undecodable += 1
    counts.first_undecodable = counts.first_undecodable or where
    if options.on_bad_utf8 == "skip":
        return None
    return raw.decode("utf-8", errors="replace")


_JSON = json.JSONDecoder()
# A JSON escape that may spell a lone surrogate (\ud800-\udfff), which no UTF-8 text contains.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _json_record(line_text: str, file: InputFile, line: int) -> object:
    try:
        return _JSON.decode(line_text)
    except json.JSONDecodeError as err:
        # Some of json's messages end in "at" ("Unterminated string starting at"): no "at at".
        at = " column" if err.msg.endswith(" at") else " at column"
        raise DataError(f"{file.path}:{line}: invalid JSON ({err.msg}{at} {err.colno}); "
                        "a .jsonl file holds one JSON object per line, fix or remove the "
                        "line") from None


def _json_segments(record: object, file: InputFile, line: int, key: str) -> list[Segment]:
    where = f"{file.path}:{line}"
    segments = record.get(key) if isinstance(record, dict) else None
    if not isinstance(segments, list):
        if isinstance(record, dict):
            found = (f"it is {type(segments).__name__}" if key in record
                     else f"found: {sorted(record)}")
        else:
            found = f"found: {type(record).__name__}"
        raise DataError(f"{where}: no list field {key!r} ({found}); --segments-key names the "
                        "field holding each document as a list of {\"text\": str, \"loss\": "
                        "bool} objects: fix the line or pass the right --segments-key")
    parsed = []
    for index, item in enumerate(segments):
        text = item.get("text") if isinstance(item, dict) else None
        loss = item.get("loss") if isinstance(item, dict) else None
        if not isinstance(text, str) or not isinstance(loss, bool):
            raise DataError(f"{where}: {key}[{index}] is {json.dumps(item)[:80]}, not an object "
                            "{\"text\": str, \"loss\": bool} (loss true marks the text's tokens "
                            "as scored targets); fix the line")
        parsed.append((text, loss))
    return parsed


def _json_text(line_text: str, file: InputFile, line: int, options: ReadOptions,
               counts: DocumentCounts) -> str | None:
    if not line_text.strip():
        return ""
    record = _json_record(line_text, file, line)
    text = record.get(options.text_key) if isinstance(record, dict) else None
    if not isinstance(text, str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{file.path}:{line}: no string field {options.text_key!r} (found: "
                        f"{keys}); pass --text-key with the field that holds the text")
    if _SURROGATE_ESCAPE.search(line_text):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            return _bad_utf8(text.encode("utf-8", "surrogatepass"), err, file, line, options,
                             counts)
    return text
