"""On-disk format of a token dataset: Megatron-LM's ``MMIDIDX`` index, a flat ``.bin``, a sidecar.

This module is the single definition of the format; the writer in ``data_tools`` and the reader in
:mod:`megabeta.data.indexed` both import it.

``PREFIX.bin`` holds the token ids of every sequence back to back, no header, in the element type
named by the index. ``PREFIX.idx`` (all integers little-endian) holds, in order:

=================  ==========================  ==============================================
field              type                        meaning
=================  ==========================  ==============================================
magic              9 bytes                     ``b"MMIDIDX\\x00\\x00"``
version            uint64                      1
dtype code         uint8                       element type of ``.bin`` (:data:`DTYPE_CODES`)
sequence count     uint64                      S
document field     uint64                      D + 1, the length of the document-index array
                                               (Megatron writes the array length, not D)
sequence lengths   int32 × S                   tokens per sequence
sequence pointers  int64 × S                   byte offset of each sequence in ``.bin``
document indices   int64 × (D + 1)             first sequence of each document; starts at 0,
                                               ends at S
=================  ==========================  ==============================================

``megabeta-data tokenize`` writes one sequence per document, so its document indices are
``0, 1, …, S``; datasets from Megatron-LM or GPT-NeoX with several sequences per document read
the same way. ``PREFIX.json`` (the sidecar) is megabeta's own addition; its fields are documented in
``docs/data.md``.

``PREFIX.mask`` (optional, megabeta's too) is the per-token loss mask: one uint8 per token of
``.bin``, in the same order, no header; ``1`` marks a scored target (the loss term that predicts
that token from the ones before it), ``0`` one the loss leaves out. The sidecar lists it
(:data:`MASK_SIDECAR_KEY`); without it every target is scored.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megabeta.data.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# magic, version, dtype code, sequence count, document-index count; "<" means no padding.
INDEX_HEADER = struct.Struct("<9sQBQQ")

# Megatron-LM's codes; any of them is readable, the writer emits uint16 or int32 token files.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("u1"),
    2: np.dtype("i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}
# The index arrays; MMIDIDX is little-endian whatever the machine.
LENGTH_DTYPE = np.dtype("<i4")
POINTER_DTYPE = np.dtype("<i8")

MASK_DTYPE = np.dtype("u1")
MASK_SIDECAR_KEY = "loss_mask"
"""Sidecar entry of the mask file: ``{"file": NAME, "sha256": HEX, "scored_tokens": N}``."""

SIDECAR_FORMAT = "megabeta.token_dataset"
SIDECAR_VERSION = 1


@dataclass(frozen=True)
class DatasetPaths:
    """The files of the dataset at ``prefix`` (``mask`` exists only for masked datasets)."""

    prefix: Path
    bin: Path
    idx: Path
    sidecar: Path
    mask: Path

    @property
    def files(self) -> tuple[Path, Path, Path, Path]:
        return self.bin, self.idx, self.sidecar, self.mask


def dataset_paths(prefix: str | os.PathLike) -> DatasetPaths:
    """Paths of ``PREFIX.bin``, ``.idx``, ``.json`` and ``.mask``; the prefix carries no suffix."""
    base = os.fspath(prefix)
    return DatasetPaths(Path(base), Path(base + ".bin"), Path(base + ".idx"), Path(base + ".json"),
                        Path(base + ".mask"))


def dtype_code(dtype: np.dtype | type) -> int:
    """Megatron's numeric code for ``dtype``."""
    wanted = np.dtype(dtype).newbyteorder("<")
    for code, candidate in DTYPE_CODES.items():
        if candidate == wanted:
            return code
    raise ValueError(f"dtype {wanted} has no MMIDIDX code; use one of "
                     f"{sorted(str(d) for d in DTYPE_CODES.values())}")


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id of the vocabulary fits in it, int32 otherwise."""
    if vocab_size <= np.iinfo(np.uint16).max + 1:
        return DTYPE_CODES[8]
    return DTYPE_CODES[4]


@dataclass(frozen=True)
class IndexHeader:
    """The fixed-size head of an ``.idx`` file."""

    dtype: np.dtype
    sequence_count: int
    document_index_count: int

    @property
    def document_count(self) -> int:
        return self.document_index_count - 1

    @property
    def index_nbytes(self) -> int:
        """Exact size of a well-formed ``.idx`` with this header."""
        return (INDEX_HEADER.size + self.sequence_count * (4 + 8)
                + self.document_index_count * 8)


def pack_index_header(dtype: np.dtype | type, sequence_count: int,
                      document_index_count: int) -> bytes:
    return INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, dtype_code(dtype), sequence_count,
                             document_index_count)


def read_index_header(idx_path: Path) -> IndexHeader:
    """Parse and check the head of ``idx_path``; DataError with the fix when it is not MMIDIDX."""
    with open(idx_path, "rb") as stream:
        raw = stream.read(INDEX_HEADER.size)
    if len(raw) < INDEX_HEADER.size:
        raise DataError(f"{idx_path}: {len(raw)} bytes, shorter than the {INDEX_HEADER.size}-byte "
                        "MMIDIDX header; the file is truncated, re-run tokenize (or merge)")
    magic, version, code, sequence_count, document_index_count = INDEX_HEADER.unpack(raw)
    if magic != INDEX_MAGIC:
        raise DataError(f"{idx_path}: not an MMIDIDX index (magic {magic!r}); pass the prefix of a "
                        "dataset written by megabeta-data tokenize, Megatron-LM or GPT-NeoX")
    if version != INDEX_VERSION:
        raise DataError(f"{idx_path}: MMIDIDX version {version}, only {INDEX_VERSION} is known")
    if code not in DTYPE_CODES:
        raise DataError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)}); "
                        "the index is damaged, re-run tokenize")
    if document_index_count < 1:
        raise DataError(f"{idx_path}: document-index count 0, Megatron indexes always hold a "
                        "leading 0; the index is damaged, re-run tokenize")
    return IndexHeader(DTYPE_CODES[code], sequence_count, document_index_count)


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes (how sidecars identify the tokenizer model)."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_sidecar(path: Path) -> dict | None:
    """The sidecar's fields, or None when there is none; DataError when it is unreadable."""
    if not path.exists():
        return None
    try:
        sidecar = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: sidecar is not valid JSON ({err}); delete it or re-run "
                        "tokenize") from None
    if not isinstance(sidecar, dict) or sidecar.get("format") != SIDECAR_FORMAT:
        raise DataError(f"{path}: not a megabeta dataset sidecar (\"format\" is not "
                        f"{SIDECAR_FORMAT!r}); delete it or re-run tokenize")
    return sidecar
