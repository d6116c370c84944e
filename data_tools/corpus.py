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
from data_tools.report import CutFile, DocumentCounts
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
    on ``--chunk-mb``, the worker count or the ranks. ``at_end`` checks, once the decompressor
    says the data ended, that the file did not end early (a decompressor that reports the end
    of a file cut short as the end of its data); what it returns is the error."""

    def __init__(self, inner: BinaryIO, errors: tuple[type[BaseException], ...],
                 at_end: Callable[[], str | None] = lambda: None) -> None:
        super().__init__()
        self.inner, self.errors, self.at_end = inner, errors, at_end
        self.error: BaseException | str | None = None
        self.ended = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        if self.error is not None or self.ended:
            return 0
        try:
            data = self.inner.read1(len(buffer))
        except self.errors as err:
            self.error = err
            return 0
        if not data:
            self.ended = True
            self.error = self.at_end()
            return 0
        buffer[:len(data)] = data
        return len(data)


_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_SKIPPABLE = 0x184D2A50  # the 16 magic numbers of skippable frames, low 4 bits free
_ZSTD_RLE_BLOCK = 1


def zstd_cut_short(path: Path) -> str | None:
    """Where the .zst file ``path`` ends inside a frame, or None when its frames are whole.

    zstandard's stream reader delivers a file cut short as if its data ended there. The frames'
    own lengths tell: each frame is a header (zstandard reads it), blocks of a 3-byte header
    and a body of the length it gives (1 byte for an RLE block), the last block flagged, then a
    4-byte checksum if the header says so (RFC 8878 §3.1.1); a skippable frame says its length.
    Only the headers are read, 3 bytes a block, so this costs little beside decoding."""
    zstandard = require_extra("zstandard", "zstd", f"{path} (a .zst input)")
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as raw:
        def read(offset: int, count: int) -> bytes:
            raw.seek(offset)
            return raw.read(count)

        offset = 0
        while offset < size:
            start = offset
            head = read(offset, 18)  # the longest frame header
            magic = int.from_bytes(head[:4], "little")
            if len(head) >= 8 and magic & ~0xF == _ZSTD_SKIPPABLE:
                offset += 8 + int.from_bytes(head[4:8], "little")
            elif magic == _ZSTD_MAGIC:
                try:
                    offset += zstandard.frame_header_size(head)
                    checksum = zstandard.get_frame_parameters(head).has_checksum
                except zstandard.ZstdError:
                    return f"it ends inside the header of the frame at byte {start:,}"
                last = False
                while not last and offset < size:
                    header = int.from_bytes(read(offset, 3), "little")
                    last = bool(header & 1)
                    body = 1 if (header >> 1) & 3 == _ZSTD_RLE_BLOCK else header >> 3
                    offset += 3 + body
                offset += 4 if last and checksum else 0
                if not last:
                    offset = size + 1
            else:  # bytes the decoder took for the end of the data
                return f"bytes {start:,}-{size:,} are not a zstd frame"
            if offset > size:
                return (f"the file ends {size:,} bytes in, inside the frame that starts at byte "
                        f"{start:,}: it was cut short")
    return None


def _decompressed(raw: BinaryIO, file: InputFile) -> tuple[BinaryIO, _UntilCorrupt | None]:
    """The decompressed stream of ``raw``, and what tells where it turned out corrupt (None for
    an uncompressed file)."""
    if file.compression == "gzip":
        # gzip raises EOFError itself on a file cut short.
        checked = _UntilCorrupt(gzip.GzipFile(fileobj=raw, mode="rb"),
                                (gzip.BadGzipFile, EOFError, zlib.error))
    elif file.compression == "zstd":
        zstandard = require_extra("zstandard", "zstd", f"{file.path} (a .zst input)")
        checked = _UntilCorrupt(
            zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True),
            (zstandard.ZstdError, EOFError), lambda: zstd_cut_short(file.path))
    else:
        return raw, None
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
        self.records = 0
        """Records yielded so far."""
        self._damage: tuple[str, int | None] | None = None
        self._raw: BinaryIO | None = None
        self._rows = (0, 1)  # parquet: rows read, rows in the file

    @property
    def bad_file(self) -> CutFile | None:
        """With --skip-bad, once the file is read: where it turned out unreadable and how many
        of its records were read before (the rest is skipped); None when it was read whole."""
        if self._damage is None:
            return None
        return CutFile(str(self.file.path), self._damage[0], self.records, self._damage[1])

    @property
    def position(self) -> int:
        """Bytes of the file on disk consumed so far (for progress)."""
        if self.file.kind == "parquet":
            return self.file.size * self._rows[0] // max(self._rows[1], 1)
        return self._raw.tell() if self._raw is not None else 0

    def chunks(self, chunk_bytes: int) -> Iterator[tuple[list, Sequence[int]]]:
        """``(records, start lines)`` of about ``chunk_bytes`` each, in file order; a parquet
        file's records are its text column's values (str, or bytes for a binary column)."""
        chunks = (self._parquet_chunks(chunk_bytes) if self.file.kind == "parquet"
                  else self._stream_chunks(chunk_bytes))
        for chunk in chunks:
            self.records += len(chunk[0])
            yield chunk

    def _stream_chunks(self, chunk_bytes: int) -> Iterator[tuple[list, Sequence[int]]]:
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
                self._bad(f"not a readable {self.file.compression} file {where}: "
                          f"{checked.error}", "re-compress it or remove it from --inputs")
                return
        if not found:
            raise DataError(f"{self.file.path}: contains no text; remove it from --inputs")

    def _bad(self, problem: str, fix: str, records_not_read: int | None = None) -> None:
        """This file is unreadable from here on (corrupt, or no text column): one error naming
        it, or with --skip-bad the rest of it skipped and the file counted."""
        if not self.skip_bad:
            raise DataError(f"{self.file.path}: {problem}; {fix}, or pass --skip-bad to skip "
                            "what cannot be read (counted)")
        self._damage = (problem, records_not_read)

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
            # Its rows cannot be found without the footer, which a file cut short loses.
            self._bad(f"not a readable parquet file from its start: {err}",
                      "rewrite it or remove it from --inputs")
            return
        rows = parquet.metadata.num_rows
        schema = parquet.schema_arrow
        if key not in schema.names:
            self._bad(f"no column {key!r} (columns: {schema.names})",
                      "pass --text-key with the column that holds the text", rows)
            return
        column = schema.field(key).type
        if not any(check(column) for check in (pa.types.is_string, pa.types.is_large_string,
                                              pa.types.is_binary, pa.types.is_large_binary)):
            self._bad(f"column {key!r} holds {column}, not text",
                      "pass --text-key with the string column that holds the text", rows)
            return
        self._rows = (0, rows)
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
            read = first + len(records) - 1
            where = f"after row {read}" if read else "from its start"
            self._bad(f"not a readable parquet file {where}: {err}",
                      "rewrite it or remove it from --inputs", rows - read)
        if records:
            yield records, range(first, first + len(records))
        elif first == 1 and self._damage is None:
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
