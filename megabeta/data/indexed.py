"""Zero-copy reader of an MMIDIDX token dataset: ``PREFIX.bin``, ``PREFIX.idx`` [, ``PREFIX.json``].

``IndexedDataset(prefix)[i]`` is sequence ``i`` as a read-only NumPy view into the memory-mapped
``.bin``; ``.tokens`` is the whole flat token array. Opening checks what is cheap to check (header,
exact file sizes, the ends of the pointer and document arrays, the sidecar's counts) so a truncated
or mismatched pair fails at once with the file name. :meth:`IndexedDataset.validate` checks the
whole index for internal consistency (O(sequences), the index only: sizes, pointers and document
indices; ``inspect`` runs it, and so does :func:`megabeta.data.build_train_val` for every dataset
a run trains or evaluates on); :meth:`IndexedDataset.check_token_ids` scans every token (O(tokens)).

A dataset may carry a per-token loss mask, ``PREFIX.mask`` (:mod:`megabeta.data.format`), mapped
beside the tokens: :attr:`IndexedDataset.has_loss_mask`, :meth:`IndexedDataset.loss_mask`,
``.loss_masks`` (flat). Opening checks its size against the token count; the O(tokens) check of
its contents against the sidecar is :meth:`IndexedDataset.check_loss_mask`.
"""

from __future__ import annotations

import hashlib
import os
from functools import cached_property

import numpy as np

from megabeta.data.errors import DataError
from megabeta.data.format import (
    INDEX_HEADER,
    LENGTH_DTYPE,
    MASK_DTYPE,
    MASK_SIDECAR_KEY,
    POINTER_DTYPE,
    IndexHeader,
    dataset_paths,
    read_index_header,
    read_sidecar,
)

# Elements per block when a full check walks a large array; bounds the temporary memory.
_CHECK_BLOCK = 1 << 22
_REBUILD_HINT = "re-run megabeta-data tokenize (or merge) to rebuild it"
_INDEX_HINT = ("the index is damaged or was edited: re-run megabeta-data tokenize (or merge) to "
               "rebuild it; `megabeta-data inspect {prefix}` reports every check")


class IndexedDataset:
    """Sequences of token ids of a memory-mapped MMIDIDX dataset; ``len`` counts sequences."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.paths = dataset_paths(prefix)
        for path in (self.paths.idx, self.paths.bin):
            if not path.is_file():
                raise DataError(f"{path}: missing; a dataset prefix names PREFIX.bin and "
                                "PREFIX.idx (pass the prefix without suffix, or run megabeta-data "
                                "tokenize)")
        self.header: IndexHeader = read_index_header(self.paths.idx)
        self._open_index()
        self._open_tokens()
        self.sidecar: dict | None = read_sidecar(self.paths.sidecar)
        if self.sidecar is not None:
            self._check_sidecar_counts()
        self._open_loss_mask()

    def _open_index(self) -> None:
        idx, header = self.paths.idx, self.header
        size = idx.stat().st_size
        if size != header.index_nbytes:
            raise DataError(f"{idx}: {size} bytes, but its header describes "
                            f"{header.sequence_count} sequences and {header.document_count} "
                            f"documents ({header.index_nbytes} bytes); the index is truncated or "
                            "damaged, " + _REBUILD_HINT)
        raw = np.memmap(idx, dtype=np.uint8, mode="r")
        count = header.sequence_count
        offset = INDEX_HEADER.size
        self.sequence_lengths = np.frombuffer(raw, LENGTH_DTYPE, count, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(raw, POINTER_DTYPE, count, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(raw, POINTER_DTYPE, header.document_index_count,
                                              offset)
        docs = self.document_indices
        if docs[0] != 0 or docs[-1] != count:
            raise DataError(f"{idx}: document indices run from {docs[0]} to {docs[-1]}, expected 0 "
                            f"to {count}; the index is damaged, " + _REBUILD_HINT)
        if count and self.sequence_pointers[0] != 0:
            raise DataError(f"{idx}: first sequence pointer is {self.sequence_pointers[0]}, not 0; "
                            "the index is damaged, " + _REBUILD_HINT)

    def _open_tokens(self) -> None:
        itemsize = self.header.dtype.itemsize
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        expected = self.num_tokens * itemsize
        if self.header.sequence_count:
            last_end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize
            if last_end != expected:
                self._check_sizes_and_pointers()  # names the first entry out of step, if one is
                raise DataError(f"{self.paths.idx}: last sequence ends at byte {last_end} but the "
                                f"lengths add up to {expected} bytes; the index is damaged, "
                                + _REBUILD_HINT)
        size = self.paths.bin.stat().st_size
        if size != expected:
            raise DataError(f"{self.paths.bin}: {size} bytes, but {self.paths.idx} describes "
                            f"{self.num_tokens} {self.header.dtype} tokens ({expected} bytes); the "
                            "files are truncated or come from different runs, " + _REBUILD_HINT)
        if self.num_tokens:
            self.tokens = np.memmap(self.paths.bin, dtype=self.header.dtype, mode="r",
                                    shape=(self.num_tokens,))
        else:  # mmap refuses an empty file
            self.tokens = np.empty(0, dtype=self.header.dtype)

    def _open_loss_mask(self) -> None:
        """Map ``PREFIX.mask`` when the dataset has one: the sidecar lists it, or there is no
        sidecar and the file is there (written by another tool). A mask the sidecar does not list
        is refused rather than ignored: it is left over from another dataset under this prefix."""
        path = self.paths.mask
        self.loss_masks: np.ndarray | None = None
        entry = None if self.sidecar is None else self.sidecar.get(MASK_SIDECAR_KEY)
        if entry is not None and not isinstance(entry, dict):
            raise DataError(f"{self.paths.sidecar}: {MASK_SIDECAR_KEY!r} is {entry!r}, not an "
                            "object with file, sha256 and scored_tokens; " + _REBUILD_HINT)
        if not path.is_file():
            if entry is not None:
                raise DataError(f"{path}: missing, but {self.paths.sidecar} lists a loss mask "
                                f"({entry.get('file')}); copy it next to the .bin and .idx, or "
                                + _REBUILD_HINT)
            return
        if self.sidecar is not None and entry is None:
            raise DataError(f"{path}: a loss mask that {self.paths.sidecar} does not list, so it "
                            "belongs to another dataset once written under this prefix; delete "
                            "it, or " + _REBUILD_HINT)
        size = path.stat().st_size
        if size != self.num_tokens * MASK_DTYPE.itemsize:
            raise DataError(f"{path}: {size} bytes, but {self.paths.idx} describes "
                            f"{self.num_tokens} tokens (one mask byte per token); the mask is "
                            "truncated or belongs to another dataset, " + _REBUILD_HINT)
        if self.num_tokens:
            self.loss_masks = np.memmap(path, dtype=MASK_DTYPE, mode="r",
                                        shape=(self.num_tokens,))
        else:  # mmap refuses an empty file
            self.loss_masks = np.empty(0, dtype=MASK_DTYPE)

    def _check_sidecar_counts(self) -> None:
        sidecar = self.sidecar
        found = {"num_documents": self.num_documents, "num_sequences": len(self),
                 "num_tokens": self.num_tokens, "dtype": str(self.header.dtype)}
        wrong = {key: (sidecar.get(key), value) for key, value in found.items()
                 if sidecar.get(key) != value}
        if wrong:
            detail = ", ".join(f"{key} {said!r} in sidecar vs {value!r} in index"
                               for key, (said, value) in wrong.items())
            raise DataError(f"{self.paths.sidecar}: does not match {self.paths.idx} ({detail}); "
                            "the sidecar belongs to another dataset, " + _REBUILD_HINT)

    def __len__(self) -> int:
        return self.header.sequence_count

    def __getitem__(self, index: int) -> np.ndarray:
        return self.tokens[self._sequence_slice(index)]

    @property
    def has_loss_mask(self) -> bool:
        """Whether the dataset has a ``PREFIX.mask`` (else every target is scored)."""
        return self.loss_masks is not None

    def loss_mask(self, index: int) -> np.ndarray:
        """Loss mask of sequence ``index`` (uint8, as long as ``self[index]``; 1 = scored target):
        a read-only view into the mapped ``PREFIX.mask``, or all ones when there is none."""
        where = self._sequence_slice(index)
        if self.loss_masks is None:
            return np.ones(where.stop - where.start, dtype=MASK_DTYPE)
        return self.loss_masks[where]

    def _sequence_slice(self, index: int) -> slice:
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"sequence {index} out of range for {count} sequences")
        index %= count
        start = int(self.sequence_pointers[index]) // self.header.dtype.itemsize
        return slice(start, start + int(self.sequence_lengths[index]))

    # Pickle the prefix, not the mapping: DataLoader workers started by spawn reopen the files
    # instead of receiving a copy of every token.
    def __getstate__(self) -> dict:
        return {"prefix": self.paths.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    @property
    def num_documents(self) -> int:
        return self.header.document_count

    @property
    def dtype(self) -> np.dtype:
        return self.header.dtype

    @property
    def vocab_size(self) -> int | None:
        """Vocabulary size recorded in the sidecar (None without one)."""
        return self._tokenizer_field("vocab_size")

    @property
    def tokenizer_sha256(self) -> str | None:
        """SHA-256 of the tokenizer model that made the dataset (None without a sidecar)."""
        return self._tokenizer_field("sha256")

    def _tokenizer_field(self, key: str):
        if self.sidecar is None:
            return None
        return (self.sidecar.get("tokenizer") or {}).get(key)

    def document_token_range(self, first: int, stop: int) -> tuple[int, int]:
        """Token offsets ``[start, end)`` in ``.tokens`` covering documents ``first … stop-1``."""
        if not 0 <= first <= stop <= self.num_documents:
            raise IndexError(f"documents [{first}, {stop}) out of range for {self.num_documents}")
        return self._sequence_token_offset(int(self.document_indices[first])), \
            self._sequence_token_offset(int(self.document_indices[stop]))

    @cached_property
    def document_starts(self) -> np.ndarray:
        """int64 ``[num_documents + 1]``: the token offset in ``.tokens`` where each document
        starts, then ``num_tokens`` (so ``np.diff`` gives the documents' lengths). From the
        index alone: a document's first sequence's pointer."""
        sequence_starts = np.append(self.sequence_pointers // self.header.dtype.itemsize,
                                    self.num_tokens).astype(np.int64)
        return sequence_starts[self.document_indices]

    def _sequence_token_offset(self, sequence: int) -> int:
        if sequence == len(self):
            return self.num_tokens
        return int(self.sequence_pointers[sequence]) // self.header.dtype.itemsize

    @cached_property
    def fingerprint(self) -> str:
        """Hash of the index, the token-file size and its first and last MiB: what a resumed run
        compares to know it reads the same data."""
        digest = hashlib.sha256()
        with open(self.paths.idx, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
        digest.update(str(self.num_tokens).encode())
        digest.update(np.asarray(self.tokens[: 1 << 19]).tobytes())
        digest.update(np.asarray(self.tokens[-(1 << 19):]).tobytes())
        if self.loss_masks is not None:  # unmasked datasets keep the fingerprint they always had
            digest.update(b"loss_mask")
            digest.update(np.asarray(self.loss_masks[: 1 << 20]).tobytes())
            digest.update(np.asarray(self.loss_masks[-(1 << 20):]).tobytes())
        return digest.hexdigest()

    def validate(self) -> None:
        """Check the index's internal consistency; DataError naming the ``.idx`` file and the
        first offending entry. O(sequences), reads the index only (not the tokens): sizes are not
        negative; the pointers start at 0 and run back to back by size × dtype size; the last
        sequence ends at the ``.bin``'s size; the document indices start at 0, never decrease and
        end at the number of sequences."""
        self._check_sizes_and_pointers()
        idx, count = self.paths.idx, len(self)
        itemsize = self.header.dtype.itemsize
        if count:
            end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize
            size = self.paths.bin.stat().st_size
            if end != size:
                raise DataError(f"{idx}: the last sequence ({count - 1}) ends at byte {end}, but "
                                f"{self.paths.bin} has {size} bytes; " + self._index_hint())
        docs = self.document_indices
        if docs[0] != 0 or docs[-1] != count:
            raise DataError(f"{idx}: document indices run from {int(docs[0])} to {int(docs[-1])}, "
                            f"expected 0 to {count} (the number of sequences); " + self._index_hint())
        for start in range(0, len(docs), _CHECK_BLOCK):
            block = docs[start:start + _CHECK_BLOCK + 1]
            out = np.flatnonzero((block < 0) | (block > count))
            if out.size:
                at = start + int(out[0])
                raise DataError(f"{idx}: document index {at} is {int(docs[at])}, outside "
                                f"[0, {count}] (the number of sequences); " + self._index_hint())
            down = np.flatnonzero(np.diff(block) < 0)
            if down.size:
                at = start + int(down[0]) + 1
                raise DataError(f"{idx}: document index {at} is {int(docs[at])}, less than "
                                f"document index {at - 1} ({int(docs[at - 1])}): document indices "
                                "must not decrease; " + self._index_hint())

    def _index_hint(self) -> str:
        return _INDEX_HINT.format(prefix=self.paths.prefix)

    def _check_sizes_and_pointers(self) -> None:
        """DataError at the first negative size or the first pointer not where the sequences
        before it end (they must be back to back, from byte 0)."""
        idx = self.paths.idx
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        itemsize = self.header.dtype.itemsize
        running = 0
        for start in range(0, len(self), _CHECK_BLOCK):
            sizes = lengths[start:start + _CHECK_BLOCK]
            negative = np.flatnonzero(sizes < 0)
            if negative.size:
                at = start + int(negative[0])
                raise DataError(f"{idx}: sequence {at} has size {int(lengths[at])}, a negative "
                                "number of tokens; " + self._index_hint())
            block = sizes.astype(np.int64) * itemsize
            expected = running + np.concatenate(([0], np.cumsum(block[:-1])))
            bad = np.flatnonzero(pointers[start:start + _CHECK_BLOCK] != expected)
            if bad.size:
                at = start + int(bad[0])
                where = (f"sequence {at - 1} ({int(lengths[at - 1])} tokens from byte "
                         f"{int(pointers[at - 1])}) ends at byte {int(expected[bad[0]])}"
                         if at else "the first sequence must start at byte 0")
                raise DataError(f"{idx}: sequence {at} starts at byte {int(pointers[at])}, but "
                                f"{where}: its sizes and pointers disagree (sequences must be back "
                                "to back); " + self._index_hint())
            running += int(block.sum())

    def check_token_ids(self, vocab_size: int | None = None) -> int:
        """Scan every token: DataError at the first id outside ``[0, vocab_size)``; returns the max.

        ``vocab_size`` defaults to the sidecar's. O(tokens): ``inspect`` runs it; training runs
        call it when asked to (``build_train_val(..., verify_token_ids=True)``).
        """
        limit = self.vocab_size if vocab_size is None else vocab_size
        highest = -1
        for start in range(0, self.num_tokens, _CHECK_BLOCK):
            block = self.tokens[start:start + _CHECK_BLOCK]
            low, high = int(block.min()), int(block.max())
            if low < 0 or (limit is not None and high >= limit):
                outside = (block < 0) if limit is None else (block < 0) | (block >= limit)
                position = start + int(np.argmax(outside))
                raise DataError(f"{self.paths.bin}: token {position} (document "
                                f"{self._document_of_token(position)}) has id "
                                f"{int(self.tokens[position])}, outside the vocabulary "
                                f"[0, {limit}); the dataset was made with another tokenizer or the "
                                "file is damaged: re-tokenize with the model this run uses")
            highest = max(highest, high)
        return highest

    def check_loss_mask(self) -> int:
        """Scan the whole mask: DataError at the first byte other than 0 or 1, or when its
        scored-token count or SHA-256 differ from the sidecar's; returns the scored-token count.
        O(tokens): ``inspect`` runs it, and so does ``build_train_val(verify_token_ids=True)``."""
        if self.loss_masks is None:
            raise DataError(f"{self.paths.mask}: the dataset has no loss mask")
        path, scored, digest = self.paths.mask, 0, hashlib.sha256()
        for start in range(0, self.num_tokens, _CHECK_BLOCK):
            block = np.asarray(self.loss_masks[start:start + _CHECK_BLOCK])
            bad = np.flatnonzero(block > 1)
            if bad.size:
                position = start + int(bad[0])
                raise DataError(f"{path}: byte {position} (document "
                                f"{self._document_of_token(position)}) is {int(block[bad[0]])}, "
                                "not 0 or 1; the mask is damaged, " + _REBUILD_HINT)
            scored += int(np.count_nonzero(block))
            digest.update(block.tobytes())
        entry = (self.sidecar or {}).get(MASK_SIDECAR_KEY)
        if entry is not None:
            said = (entry.get("scored_tokens"), entry.get("sha256"))
            if said != (scored, digest.hexdigest()):
                raise DataError(f"{path}: {scored} scored tokens, sha256 {digest.hexdigest()}; "
                                f"{self.paths.sidecar} says {said[0]} and {said[1]}: the mask was "
                                "changed after it was written, " + _REBUILD_HINT)
        return scored

    def _document_of_token(self, position: int) -> int:
        itemsize = self.header.dtype.itemsize
        sequence = int(np.searchsorted(self.sequence_pointers, position * itemsize, "right")) - 1
        return int(np.searchsorted(self.document_indices, sequence, "right")) - 1
