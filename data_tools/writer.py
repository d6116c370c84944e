"""Streaming writer of an MMIDIDX token dataset (format: :mod:`megabeta.data.format`).

Tokens go straight to the ``.bin``; sequence lengths and document ends are spilled to anonymous
temporary files rather than kept in lists, so memory stays flat however many documents pass
through; the ``.idx`` is assembled from the spills at the end in fixed-size blocks. The ``.bin``,
``.idx`` and sidecar ``.json`` appear under their final names only when all three are complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from types import TracebackType

import numpy as np

from data_tools.atomic import AtomicFiles
from megabeta.data.errors import DataError
from megabeta.data.format import (
    LENGTH_DTYPE,
    POINTER_DTYPE,
    SIDECAR_FORMAT,
    SIDECAR_VERSION,
    dataset_paths,
    dtype_code,
    pack_index_header,
)
from megabeta.data.indexed import IndexedDataset

_BLOCK = 1 << 20  # elements per block when assembling the index or copying tokens
_MAX_LENGTH = np.iinfo(LENGTH_DTYPE).max


class IndexedDatasetWriter:
    """Appends documents (or whole datasets) and commits ``PREFIX.bin/.idx/.json`` atomically."""

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype,
                 overwrite: bool = False) -> None:
        self.paths = dataset_paths(prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        dtype_code(self.dtype)
        self._files = AtomicFiles([self.paths.bin, self.paths.idx, self.paths.sidecar], overwrite)
        spill_dir = self.paths.bin.parent
        self._bin = open(self._files.temp(self.paths.bin), "wb")
        self._lengths = tempfile.TemporaryFile(dir=spill_dir)
        self._document_ends = tempfile.TemporaryFile(dir=spill_dir)
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents of one sequence each: ``tokens`` back to back, ``lengths`` of each."""
        if tokens.dtype != self.dtype:
            raise TypeError(f"tokens are {tokens.dtype}, this dataset holds {self.dtype}")
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size and int(lengths.max()) > _MAX_LENGTH:
            raise DataError(f"{self.paths.bin}: a document of {int(lengths.max())} tokens exceeds "
                            f"the int32 sequence length of MMIDIDX; split it (e.g. --split "
                            "paragraph)")
        count = lengths.size
        ends = self.num_sequences + np.arange(1, count + 1, dtype=np.int64)
        self._append(np.ascontiguousarray(tokens), lengths, ends)

    def add_dataset(self, source: IndexedDataset) -> None:
        """Append every sequence and document of ``source`` (same token type), in order."""
        if source.dtype != self.dtype:
            raise DataError(f"{source.paths.idx}: holds {source.dtype} tokens, the output holds "
                            f"{self.dtype}; merge only datasets made by the same tokenizer")
        with open(source.paths.bin, "rb") as stream:
            shutil.copyfileobj(stream, self._bin, _BLOCK * 8)
        ends = self.num_sequences + np.asarray(source.document_indices[1:], dtype=np.int64)
        self._append(b"", np.asarray(source.sequence_lengths, dtype=np.int64), ends,
                     copied_tokens=source.num_tokens)

    def _append(self, tokens: bytes | np.ndarray, lengths: np.ndarray,
                document_ends: np.ndarray, copied_tokens: int | None = None) -> None:
        self._bin.write(tokens)
        self._lengths.write(lengths.astype(LENGTH_DTYPE).tobytes())
        self._document_ends.write(document_ends.astype(POINTER_DTYPE).tobytes())
        self.num_sequences += lengths.size
        self.num_documents += document_ends.size
        self.num_tokens += int(lengths.sum()) if copied_tokens is None else copied_tokens

    def commit(self, sidecar: dict) -> dict:
        """Write the index and the sidecar (``sidecar`` plus the format and count fields), then
        rename all three files into place; returns the full sidecar."""
        self._bin.close()
        with open(self._files.temp(self.paths.idx), "wb") as stream:
            self._write_index(stream)
        full = {
            "format": SIDECAR_FORMAT,
            "format_version": SIDECAR_VERSION,
            "dtype": str(self.dtype),
            "dtype_code": dtype_code(self.dtype),
            "num_documents": self.num_documents,
            "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
            **sidecar,
        }
        with open(self._files.temp(self.paths.sidecar), "w", encoding="utf-8") as stream:
            json.dump(full, stream, indent=2)
            stream.write("\n")
        self._files.commit()
        return full

    def _write_index(self, stream) -> None:
        stream.write(pack_index_header(self.dtype, self.num_sequences, self.num_documents + 1))
        self._lengths.seek(0)
        shutil.copyfileobj(self._lengths, stream, _BLOCK * LENGTH_DTYPE.itemsize)
        self._lengths.seek(0)
        offset = 0
        for block in iter(lambda: self._lengths.read(_BLOCK * LENGTH_DTYPE.itemsize), b""):
            sizes = np.frombuffer(block, LENGTH_DTYPE).astype(np.int64) * self.dtype.itemsize
            ends = offset + np.cumsum(sizes)
            stream.write((ends - sizes).astype(POINTER_DTYPE).tobytes())
            offset = int(ends[-1])
        stream.write(np.zeros(1, POINTER_DTYPE).tobytes())
        self._document_ends.seek(0)
        shutil.copyfileobj(self._document_ends, stream, _BLOCK * POINTER_DTYPE.itemsize)

    def close(self) -> None:
        """Release everything; files not committed are removed."""
        self._bin.close()
        self._lengths.close()
        self._document_ends.close()
        self._files.discard()

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
