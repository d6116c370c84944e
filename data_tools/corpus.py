"""Reading a corpus: which files are accepted, how they split into documents, how bytes become text.

Accepted inputs: ``.txt``, ``.jsonl``, their ``.gz`` and ``.zst`` variants (a bare ``.zst`` is
JSONL; zstandard is the extra ``megabeta[zstd]``) and ``.parquet`` (pyarrow, ``megabeta[parquet]``),
given as files, directories (their accepted files, sorted) or globs. A JSONL line is one document
(its ``--text-key`` field, or with ``--segments-key`` a list of ``{"text", "loss"}`` segments that
mark the scored spans); a parquet row is one document (its ``--text-key`` string column, read one
row group at a time); a ``.txt`` file is one document, or one per line (``--split line``) or per
blank-line-separated paragraph (``--split paragraph``). Reading yields raw byte records so the
expensive part (UTF-8 and JSON decoding) can run in worker processes; :func:`decode_document`
turns a record into text and :func:`decode_segments` into segments, counting what they skip or
repair.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from data_tools.extras import require_extra
from megabeta.data.errors import DataError

SPLIT_MODES = ("none", "line", "paragraph")
BAD_UTF8_POLICIES = ("replace", "skip", "error")
_KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
ACCEPTED = ".txt, .jsonl, .parquet, .txt.gz, .jsonl.gz, .txt.zst, .jsonl.zst, .zst"


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
    keep_empty: bool = False
    """Write an empty document as a document without tokens (as Megatron does) instead of
    skipping it, so document indices follow the input's records."""
    skip_bad: bool = False
    """Skip (and count) a record that is not valid JSON or lacks the text field, and the rest of
    a file that turns out corrupt (or a parquet file without the text column), instead of
    stopping with an error."""


@dataclass(frozen=True)
class InputFile:
    """One accepted input file."""

    path: Path
    kind: str
    """txt, jsonl or parquet"""
    compression: str | None
    """gzip, zstd or None"""
    size: int
    """Bytes on disk (compressed size for .gz and .zst)."""

    def where(self, record: int) -> str:
        """Where record ``record`` (1-based line, or row of a parquet file) is, for messages."""
        return f"{self.path} row {record}" if self.kind == "parquet" else f"{self.path}:{record}"


def file_type(path: Path) -> tuple[str, str | None] | None:
    """(kind, compression) of an accepted input file's name, None for any other."""
    name = path.name
    compression = next((c for suffix, c in _COMPRESSIONS.items() if name.endswith(suffix)), None)
    base = name.rsplit(".", 1)[0] if compression else name
    kind = next((kind for suffix, kind in _KINDS.items() if base.endswith(suffix)), None)
    if kind is None and compression == "zstd":
        kind = "jsonl"  # a bare .zst: corpora so compressed (The Pile's) are JSONL
    if kind is None or (kind == "parquet" and compression):
        return None
    return kind, compression


def _expand(given: str | Path) -> list[Path]:
    """The files ``given`` stands for: itself, a directory's accepted files, or a glob's matches,
    sorted (so a run's input order does not depend on the file system)."""
    path = Path(given)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*")
                       if p.is_file() and not p.name.startswith(".") and file_type(p))
        if not found:
            raise DataError(f"{path}: a directory without input files ({ACCEPTED})")
        return found
    if not path.exists() and glob.has_magic(str(given)):
        found = sorted(Path(p) for p in glob.glob(str(given), recursive=True)
                       if Path(p).is_file() and file_type(Path(p)))
        if not found:
            raise DataError(f"{given}: the pattern matches no input files ({ACCEPTED})")
        return found
    return [path]


def input_files(paths: list[str] | list[Path]) -> list[InputFile]:
    """Check every input up front (exists, a file, non-empty, known type); DataError if not.
    Directories and globs stand for their accepted files."""
    if not paths:
        raise DataError("no input files; pass one or more files to --inputs")
    files = []
    for path in (path for given in paths for path in _expand(given)):
        if not path.exists():
            raise DataError(f"{path}: no such file; check the path given to --inputs")
        kind_compression = file_type(path)
        if kind_compression is None:
            raise DataError(f"{path}: unsupported file type; inputs must end in {ACCEPTED} "
                            "(rename it or convert it)")
        size = path.stat().st_size
        if size == 0:
            raise DataError(f"{path}: empty file; remove it from --inputs")
        kind, compression = kind_compression
        # The extras are needed now or not at all: say so before reading a byte.
        if compression == "zstd":
            require_extra("zstandard", "zstd", f"{path} (a .zst input)")
        if kind == "parquet":
            require_extra("pyarrow.parquet", "parquet", f"{path} (a .parquet input)")
        files.append(InputFile(path, kind, compression, size))
    return files


_READ_BUFFER = 1 << 20
_PARQUET_BATCH_ROWS = 1024


class _UntilCorrupt(io.RawIOBase):
    """A decompressing stream that ends at its first undecodable byte instead of raising, and
    keeps the error (``error``). Each read is one ``read1`` of the decompressor (one read of the
    compressed file, of its fixed size), so what was decoded before the damage is delivered
    rather than lost with the failing call, and how much that is depends on the file alone, not
    on ``--chunk-mb``, the worker count or the ranks."""

    def __init__(self, inner: BinaryIO, errors: tuple[type[BaseException], ...]) -> None:
        super().__init__()
        self.inner, self.errors = inner, errors
        self.error: BaseException | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        if self.error is not None:
            return 0
        try:
            data = self.inner.read1(len(buffer))
        except self.errors as err:
            self.error = err
            return 0
        buffer[:len(data)] = data
        return len(data)


def _decompressed(raw: BinaryIO, file: InputFile) -> tuple[BinaryIO, _UntilCorrupt | None]:
    """The decompressed stream of ``raw``, and what tells where it turned out corrupt (None for
    an uncompressed file)."""
    if file.compression == "gzip":
        inner, errors = gzip.GzipFile(fileobj=raw, mode="rb"), (gzip.BadGzipFile, EOFError,
                                                                 zlib.error)
    elif file.compression == "zstd":
        zstandard = require_extra("zstandard", "zstd", f"{file.path} (a .zst input)")
        inner = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        errors = (zstandard.ZstdError, EOFError)
    else:
        return raw, None
    checked = _UntilCorrupt(inner, errors)
    return io.BufferedReader(checked, _READ_BUFFER), checked


class RecordReader:
    """Raw records of one input file, in chunks: the bytes of each document and the 1-based line
    where it starts. Line records keep their line ending (:func:`decode_document` drops it), so a
    chunk of lines is one ``readlines`` call: the reading process, which feeds the workers, does
    little per line."""

    def __init__(self, file: InputFile, options: ReadOptions) -> None:
        self.file = file
        self.split = "line" if file.kind == "jsonl" else options.split
        self.text_key = options.text_key
        self.skip_bad = options.skip_bad
        self.bad_file: str | None = None
        """With --skip-bad: where this file turned out unreadable (its records before that were
        read, the rest is skipped); None when it was read whole."""
        self._raw: BinaryIO | None = None
        self._rows = (0, 1)  # parquet: rows read, rows in the file

    @property
    def position(self) -> int:
        """Bytes of the file on disk consumed so far (for progress)."""
        if self.file.kind == "parquet":
            return self.file.size * self._rows[0] // max(self._rows[1], 1)
        return self._raw.tell() if self._raw is not None else 0

    def chunks(self, chunk_bytes: int) -> Iterator[tuple[list, Sequence[int]]]:
        """``(records, start lines)`` of about ``chunk_bytes`` each, in file order; a parquet
        file's records are its text column's values (str, or bytes for a binary column)."""
        if self.file.kind == "parquet":
            yield from self._parquet_chunks(chunk_bytes)
            return
        found = False
        # A large buffer: readlines through the default 8 KiB one took twice as long.
        with open(self.file.path, "rb", buffering=_READ_BUFFER) as raw:
            self._raw = raw
            stream, checked = _decompressed(raw, self.file)
            cut = (lambda: False) if checked is None else (lambda: checked.error is not None)
            last = 0
            for chunk in self._chunks(stream, chunk_bytes, cut):
                found = True
                last = chunk[1][-1]
                yield chunk
            if cut():
                where = f"after the record at line {last}" if last else "from its start"
                self._bad(f"not a readable {self.file.compression} file {where} "
                          f"({checked.error})", "re-compress it or remove it from --inputs")
                return
        if not found:
            raise DataError(f"{self.file.path}: contains no text; remove it from --inputs")

    def _bad(self, problem: str, fix: str) -> None:
        """This file is unreadable from here on (corrupt, or no text column): one error naming
        it, or with --skip-bad the rest of it skipped and the file counted."""
        if not self.skip_bad:
            raise DataError(f"{self.file.path}: {problem}; {fix}, or pass --skip-bad to skip "
                            "what cannot be read (counted)")
        self.bad_file = f"{self.file.path}: {problem}"

    def _parquet_chunks(self, chunk_bytes: int) -> Iterator[tuple[list, Sequence[int]]]:
        """Rows of the text column, a batch at a time (pyarrow reads one row group at a time,
        and only that column), cut into chunks of about ``chunk_bytes``."""
        pq = require_extra("pyarrow.parquet", "parquet", f"{self.file.path} (a .parquet input)")
        import pyarrow as pa

        path, key = self.file.path, self.text_key
        try:
            # No pre-buffering: with it, pyarrow kept every column chunk read until the file
            # closed (93 MB held for a 90 MB file), so memory grew with the file.
            parquet = pq.ParquetFile(path, pre_buffer=False)
        except (pa.ArrowException, OSError) as err:
            self._bad(f"not a readable parquet file ({err})",
                             "rewrite it or remove it from --inputs")
            return
        schema = parquet.schema_arrow
        if key not in schema.names:
            self._bad(f"no column {key!r} (columns: {schema.names})",
                             "pass --text-key with the column that holds the text")
            return
        column = schema.field(key).type
        if not any(check(column) for check in (pa.types.is_string, pa.types.is_large_string,
                                              pa.types.is_binary, pa.types.is_large_binary)):
            self._bad(f"column {key!r} holds {column}, not text",
                             "pass --text-key with the string column that holds the text")
            return
        self._rows = (0, parquet.metadata.num_rows)
        records: list = []
        size = 0
        first = 1
        try:
            for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[key]):
                for value in batch.column(0).to_pylist():
                    records.append(value)
                    size += len(value) if value is not None else 0
                    if size >= chunk_bytes:
                        yield records, range(first, first + len(records))
                        first += len(records)
                        records, size = [], 0
                self._rows = (self._rows[0] + batch.num_rows, self._rows[1])
        except (pa.ArrowException, OSError) as err:
            # The rows read before are whole (pyarrow decodes a batch or raises), so they stay.
            self._bad(f"not a readable parquet file after row {first + len(records) - 1} "
                      f"({err})", "rewrite it or remove it from --inputs")
        if records:
            yield records, range(first, first + len(records))
        elif first == 1 and self.bad_file is None:
            raise DataError(f"{path}: contains no rows; remove it from --inputs")

    def __iter__(self) -> Iterator[tuple[bytes, int]]:
        for records, lines in self.chunks(1 << 20):
            yield from zip(records, lines)

    def _chunks(self, stream: BinaryIO, chunk_bytes: int,
                cut: Callable[[], bool]) -> Iterator[tuple[list[bytes], Sequence[int]]]:
        """``cut()``: the stream ended at a corrupt byte; the record it was in is incomplete and
        left out (a line without its line ending, the file or paragraph being read)."""
        if self.split == "none":
            whole = stream.read()
            if not cut():
                yield [whole], [1]
        elif self.split == "line":
            first = 1
            while lines := stream.readlines(chunk_bytes):
                if cut() and not lines[-1].endswith(b"\n"):
                    lines.pop()
                if lines:
                    yield lines, range(first, first + len(lines))
                    first += len(lines)
        else:
            records, starts, size = [], [], 0
            for record, start in _paragraphs(stream, cut):
                records.append(record)
                starts.append(start)
                size += len(record)
                if size >= chunk_bytes:
                    yield records, starts
                    records, starts, size = [], [], 0
            if records:
                yield records, starts


def _paragraphs(stream: BinaryIO, cut: Callable[[], bool]) -> Iterator[tuple[bytes, int]]:
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
    if lines and not cut():
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
    empty_kept: int = 0
    """Empty documents written (--keep-empty)."""
    bad: int = 0
    """Records skipped by --skip-bad (not JSON, no text field, null)."""
    first_bad: str | None = None
    bad_files: int = 0
    """Files --skip-bad read only up to where they turned out unreadable (corrupt .gz, .zst or
    .parquet; a parquet file without the text column, wholly)."""
    first_bad_file: str | None = None

    def add_bad_file(self, where: str) -> None:
        self.bad_files += 1
        self.first_bad_file = self.first_bad_file or where

    def add(self, later: DocumentCounts) -> None:
        """Fold in the counts of input that comes after this one's."""
        self.documents += later.documents
        self.empty += later.empty
        self.first_empty = self.first_empty or later.first_empty
        self.undecodable += later.undecodable
        self.first_undecodable = self.first_undecodable or later.first_undecodable
        self.empty_kept += later.empty_kept
        self.bad += later.bad
        self.first_bad = self.first_bad or later.first_bad
        self.bad_files += later.bad_files
        self.first_bad_file = self.first_bad_file or later.first_bad_file

    def as_report(self, policy: str) -> dict:
        report = {"empty_documents_skipped": self.empty, "first_empty_document": self.first_empty,
                  "undecodable_documents": self.undecodable, "undecodable_policy": policy,
                  "first_undecodable_document": self.first_undecodable}
        # Only when there are any: the reports of runs without them read as they always have.
        if self.empty_kept:
            report["empty_documents_kept"] = self.empty_kept
        if self.bad:
            report.update(bad_records_skipped=self.bad, first_bad_record=self.first_bad)
        if self.bad_files:
            report.update(bad_files_cut=self.bad_files, first_bad_file=self.first_bad_file)
        return report


class _BadRecord(Exception):
    """A record that cannot be a document (not JSON, no text field, null): an error naming it,
    or with --skip-bad a skipped and counted record."""


def _skip_or_fail(err: _BadRecord, file: InputFile, line: int, options: ReadOptions,
                  counts: DocumentCounts) -> None:
    where = file.where(line)
    if not options.skip_bad:
        raise DataError(f"{where}: {err}; or pass --skip-bad to skip such records (counted)")
    counts.bad += 1
    counts.first_bad = counts.first_bad or where


def decode_document(raw: bytes | str | None, file: InputFile, line: int, options: ReadOptions,
                    counts: DocumentCounts) -> str | None:
    """Text of one record, or None when it is skipped (and counted); "" for an empty document
    kept by ``options.keep_empty``."""
    try:
        if file.kind == "parquet" and not isinstance(raw, bytes):
            if raw is None:
                raise _BadRecord(f"null in column {options.text_key!r}; fill or drop the row")
            text = raw  # arrow strings are valid UTF-8
        else:
            if file.kind == "txt" and options.split == "line":
                raw = _strip_eol(raw)
            text = _utf8(raw, file, line, options, counts)
            if text is not None and file.kind == "jsonl":
                text = _json_text(text, file, line, options, counts)
    except _BadRecord as err:
        return _skip_or_fail(err, file, line, options, counts)
    if text is None:
        return None
    if not text:
        return _empty(file, line, options, counts, "")
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
        return _empty(file, line, options, counts, [])
    try:
        segments = _json_segments(_json_record(line_text), options.segments_key)
    except _BadRecord as err:
        return _skip_or_fail(err, file, line, options, counts)
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
        return _empty(file, line, options, counts, [])
    counts.documents += 1
    return segments


def _utf8(raw: bytes, file: InputFile, line: int, options: ReadOptions,
          counts: DocumentCounts) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return _bad_utf8(raw, err, file, line, options, counts)


def _empty(file: InputFile, line: int, options: ReadOptions, counts: DocumentCounts,
           kept: str | list) -> str | list | None:
    """``kept`` (an empty document) with --keep-empty, else None; counted either way."""
    if options.keep_empty:
        counts.empty_kept += 1
        return kept
    counts.empty += 1
    counts.first_empty = counts.first_empty or file.where(line)
    return None


def _bad_utf8(raw: bytes, err: UnicodeError, file: InputFile, line: int, options: ReadOptions,
              counts: DocumentCounts) -> str | None:
    where = file.where(line)
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


def _json_record(line_text: str) -> object:
    try:
        return _JSON.decode(line_text)
    except json.JSONDecodeError as err:
        # Some of json's messages end in "at" ("Unterminated string starting at"): no "at at".
        at = " column" if err.msg.endswith(" at") else " at column"
        raise _BadRecord(f"invalid JSON ({err.msg}{at} {err.colno}); a .jsonl file holds one "
                         "JSON object per line, fix or remove the line") from None


def _json_segments(record: object, key: str) -> list[Segment]:
    segments = record.get(key) if isinstance(record, dict) else None
    if not isinstance(segments, list):
        if isinstance(record, dict):
            found = (f"it is {type(segments).__name__}" if key in record
                     else f"found: {sorted(record)}")
        else:
            found = f"found: {type(record).__name__}"
        raise _BadRecord(f"no list field {key!r} ({found}); --segments-key names the field "
                         "holding each document as a list of {\"text\": str, \"loss\": bool} "
                         "objects: fix the line or pass the right --segments-key")
    parsed = []
    for index, item in enumerate(segments):
        text = item.get("text") if isinstance(item, dict) else None
        loss = item.get("loss") if isinstance(item, dict) else None
        if not isinstance(text, str) or not isinstance(loss, bool):
            raise _BadRecord(f"{key}[{index}] is {json.dumps(item)[:80]}, not an object "
                             "{\"text\": str, \"loss\": bool} (loss true marks the text's "
                             "tokens as scored targets); fix the line")
        parsed.append((text, loss))
    return parsed


def _json_text(line_text: str, file: InputFile, line: int, options: ReadOptions,
               counts: DocumentCounts) -> str | None:
    if not line_text.strip():
        return ""
    record = _json_record(line_text)
    text = record.get(options.text_key) if isinstance(record, dict) else None
    if not isinstance(text, str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise _BadRecord(f"no string field {options.text_key!r} (found: {keys}); pass "
                         "--text-key with the field that holds the text")
    if _SURROGATE_ESCAPE.search(line_text):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            return _bad_utf8(text.encode("utf-8", "surrogatepass"), err, file, line, options,
                             counts)
    return text
