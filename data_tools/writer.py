"""Streaming writer of an MMIDIDX token dataset (format: :mod:`megabeta.data.format`).

Tokens go straight to the ``.bin``; sequence lengths and document ends are spilled to anonymous
temporary files rather than kept in lists, so memory stays flat however many documents pass
through; the ``.idx`` is assembled from the spills at the end in fixed-size blocks. A writer made
with ``loss_mask=True`` also streams one mask byte per token to ``.mask``, hashing and counting it
on the way for the sidecar. The ``.bin``, ``.idx``, ``.mask`` and sidecar ``.json`` appear under
their final names only when all are complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from types import TracebackType

import numpy as np

from megabeta.data.errors import DataError, refuse_existing
from megabeta.data.format import (
    LENGTH_DTYPE,
    MASK_DTYPE,
    MASK_SIDECAR_KEY,
    POINTER_DTYPE,
    SIDECAR_FORMAT,
    SIDECAR_VERSION,
    dataset_paths,
    dtype_code,
    pack_index_header,
)
from megabeta.data.indexed import IndexedDataset
from megabeta.storage.durable import AtomicFiles

_BLOCK = 1 << 20  # elements per block when assembling the index or copying tokens
_MAX_LENGTH = np.iinfo(LENGTH_DTYPE).max


class IndexedDatasetWriter:
    """Appends documents (or whole datasets) and commits ``PREFIX.bin/.idx/.json`` (and
    ``.mask`` when ``loss_mask``) atomically. Without a mask, committing with ``overwrite``
    removes a mask left by the dataset it replaces, which would not belong to the new one."""

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype, overwrite: bool = False,
                 loss_mask: bool = False) -> None:
        self.paths = dataset_paths(prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        dtype_code(self.dtype)
        # The sidecar last: it is what names the mask.
        finals = [self.paths.bin, self.paths.idx, *([self.paths.mask] if loss_mask else []),
                  self.paths.sidecar]
        refuse_existing([*([] if loss_mask else [self.paths.mask]), *finals], overwrite)
        self._files = AtomicFiles(finals)
        spill_dir = self.paths.bin.parent
        self._bin = open(self._files.temp(self.paths.bin), "wb")
        self._mask = _MaskStream(self._files.temp(self.paths.mask)) if loss_mask else None
        self._lengths = tempfile.TemporaryFile(dir=spill_dir)
        self._document_ends = tempfile.TemporaryFile(dir=spill_dir)
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray,
                      mask: np.ndarray | None = None) -> None:
        """Append documents of one sequence each (none for a length of 0): ``tokens`` back to
        back, ``lengths`` of each; ``mask`` (one uint8 per token) exactly when the writer was made
        with ``loss_mask``."""
        if tokens.dtype != self.dtype:
            raise TypeError(f"tokens are {tokens.dtype}, this dataset holds {self.dtype}")
        if (mask is None) != (self._mask is None):
            raise TypeError("a mask is required by a writer made with loss_mask=True, and "
                            "refused by one without")
        if mask is not None and (mask.dtype != MASK_DTYPE or mask.shape != tokens.shape):
            raise TypeError(f"mask of {mask.dtype} {mask.shape} for tokens {tokens.shape}; need "
                            "one uint8 per token")
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size and int(lengths.max()) > _MAX_LENGTH:
            raise DataError(f"{self.paths.bin}: a document of {int(lengths.max())} tokens exceeds "
                            f"the int32 sequence length of MMIDIDX; split it (e.g. --split "
                            "paragraph)")
        if mask is not None:
            self._mask.write(mask)
        # A document of no tokens (--keep-empty) has no sequence: its end repeats the last one,
        # as in Megatron's datasets.
        ends = self.num_sequences + np.cumsum(lengths > 0, dtype=np.int64)
        self._append(np.ascontiguousarray(tokens), lengths[lengths > 0], ends)

    def add_dataset(self, source: IndexedDataset) -> None:
        """Append every sequence and document of ``source`` (same token type), in order."""
        if source.dtype != self.dtype:
            raise DataError(f"{source.paths.idx}: holds {source.dtype} tokens, the output holds "
                            f"{self.dtype}; merge only datasets made by the same tokenizer")
        with open(source.paths.bin, "rb") as stream:
            shutil.copyfileobj(stream, self._bin, _BLOCK * 8)
        if self._mask is not None:
            # A source without a mask scores every target: its mask is all ones.
            for start in range(0, source.num_tokens, _BLOCK):
                stop = min(start + _BLOCK, source.num_tokens)
                self._mask.write(np.asarray(source.loss_masks[start:stop])
                                 if source.has_loss_mask
                                 else np.ones(stop - start, dtype=MASK_DTYPE))
        elif source.has_loss_mask:
            raise DataError(f"{source.paths.mask}: the dataset has a loss mask, but its output "
                            f"{self.paths.prefix} is written without one")
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
        }
        if self._mask is not None:
            self._mask.close()
            full[MASK_SIDECAR_KEY] = {"file": self.paths.mask.name,
                                      "sha256": self._mask.digest.hexdigest(),
                                      "scored_tokens": self._mask.scored}
        full.update(sidecar)
        with open(self._files.temp(self.paths.sidecar), "w", encoding="utf-8") as stream:
            json.dump(full, stream, indent=2)
            stream.write("\n")
        self._files.commit()
        if self._mask is None:
            self.paths.mask.unlink(missing_ok=True)  # only there with overwrite (checked above)
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
        if self._mask is not None:
            self._mask.close()
        self._lengths.close()
        self._document_ends.close()
        self._files.discard()

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


class _MaskStream:
    """The ``.mask`` being written, with the SHA-256 and the count of scored tokens so far."""

    def __init__(self, path: os.PathLike) -> None:
        self._file = open(path, "wb")
        self.digest = hashlib.sha256()
        self.scored = 0

    def write(self, mask: np.ndarray) -> None:
        data = np.ascontiguousarray(mask, dtype=MASK_DTYPE).tobytes()
        self._file.write(data)
        self.digest.update(data)
        self.scored += int(np.count_nonzero(mask))

    def close(self) -> None:
        self._file.close()
