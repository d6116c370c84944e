"""Fixed-length next-token samples packed across document boundaries.

The documents of a token range lie back to back in ``.bin``, each ending with EOS, so the range is
one stream. Sample ``i`` is ``stream[i·seq_len : i·seq_len + seq_len + 1]``: ``seq_len + 1`` tokens,
inputs ``[:-1]`` and targets ``[1:]``; consecutive samples share one boundary token so every token
of the stream is a target exactly once. The tail shorter than a sample is not used. Samples come
out as int64 arrays (a copy of ``seq_len + 1`` tokens, ready for an embedding lookup), or, when the
dataset has a loss mask, as :class:`MaskedSample` with the matching slice of the mask.

:class:`DocumentDataset` (``data.align = "document"``) cuts samples at document starts instead:
for tasks whose documents are short, every sample is one document from its first token, padded
past its end, the padded targets masked (Megatron's ``eod_mask_loss`` carried to its end: nothing
after a document is scored, and no document sees another).
"""

from __future__ import annotations

import hashlib

import numpy as np

from megabeta.data.errors import DataError
from megabeta.data.indexed import IndexedDataset
from megabeta.data.sample import MaskedSample


class PackedDataset:
    """``len(self)`` samples of ``seq_len + 1`` tokens from ``source.tokens[start:end]``."""

    def __init__(self, source: IndexedDataset, seq_len: int,
                 token_range: tuple[int, int] | None = None, name: str = "") -> None:
        if seq_len < 1:
            raise DataError(f"seq_len {seq_len}: must be at least 1")
        start, end = (0, source.num_tokens) if token_range is None else token_range
        if not 0 <= start <= end <= source.num_tokens:
            raise DataError(f"{source.paths.bin}: token range [{start}, {end}) outside the "
                            f"{source.num_tokens} tokens of the dataset")
        available = end - start
        if available < seq_len + 1:
            part = f" ({name})" if name else ""
            raise DataError(f"{source.paths.bin}{part}: {available} tokens, fewer than one sample "
                            f"of seq_len + 1 = {seq_len + 1}; use a seq_len of at most "
                            f"{max(available - 1, 0)}, add data, or change the split")
        self.source = source
        self.seq_len = seq_len
        self.start, self.end = start, end
        self._length = (available - 1) // seq_len
        self.has_loss_mask = source.has_loss_mask

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> np.ndarray | MaskedSample:
        if not 0 <= index < self._length:
            raise IndexError(f"sample {index} out of range for {self._length} samples")
        first = self.start + index * self.seq_len
        tokens = self.source.tokens[first:first + self.seq_len + 1].astype(np.int64)
        if not self.has_loss_mask:
            return tokens
        mask = np.array(self.source.loss_masks[first:first + self.seq_len + 1])
        return MaskedSample(tokens, mask)

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(self.source.fingerprint.encode())
        digest.update(f"packed:{self.start}:{self.end}:{self.seq_len}".encode())
        return digest.hexdigest()


class DocumentDataset:
    """Samples of ``seq_len + 1`` tokens that start at the documents of ``documents`` (a range of
    ``source``'s documents; default all), padded with ``pad_id`` past the document's end and
    masked there. A document longer than one sample goes on in the next ones, ``seq_len`` tokens
    on each time (consecutive samples share a boundary token, as packed ones do), so every token
    but a document's first is a target exactly once. Documents of one token have no target and
    give no sample. Items are always :class:`MaskedSample` (the padding needs a mask); where the
    source has a mask it masks the document's own targets too.

    The padding id is irrelevant to the loss: a causal model's outputs at a document's positions
    do not depend on the tokens after it, and the padded targets are not scored."""

    has_loss_mask = True

    def __init__(self, source: IndexedDataset, seq_len: int, documents: range | None = None,
                 name: str = "", pad_id: int = 0) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len {seq_len}: must be at least 1")
        documents = range(source.num_documents) if documents is None else documents
        if not 0 <= documents.start <= documents.stop <= source.num_documents:
            raise DataError(f"{source.paths.bin}: documents [{documents.start}, "
                            f"{documents.stop}) outside the {source.num_documents} documents")
        sequence_starts = np.append(source.sequence_pointers // source.dtype.itemsize,
                                    source.num_tokens)
        # Token offsets of the documents' starts, and of the end of the last one.
        starts = sequence_starts[source.document_indices[documents.start:documents.stop + 1]]
        lengths = np.diff(starts)
        per_document = np.maximum(0, -(-(lengths - 1) // seq_len))
        total = int(per_document.sum())
        if total == 0:
            part = f" ({name})" if name else ""
            raise DataError(f"{source.paths.bin}{part}: no document of at least 2 tokens, so no "
                            "sample has a target; add data, change the split, or use "
                            "data.align = \"packed\"")
        owner = np.repeat(np.arange(len(lengths)), per_document)
        within = np.arange(total) - np.repeat(np.cumsum(per_document) - per_document, per_document)
        self.source = source
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.documents = documents
        self._starts = starts[owner] + within * seq_len
        self._ends = starts[owner + 1]

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> MaskedSample:
        if not 0 <= index < len(self._starts):
            raise IndexError(f"sample {index} out of range for {len(self._starts)} samples")
        first = int(self._starts[index])
        stop = min(first + self.seq_len + 1, int(self._ends[index]))
        tokens = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        tokens[:stop - first] = self.source.tokens[first:stop]
        mask = np.zeros(self.seq_len + 1, dtype=np.uint8)
        if self.source.has_loss_mask:
            mask[:stop - first] = self.source.loss_masks[first:stop]
        else:
            mask[:stop - first] = 1
        return MaskedSample(tokens, mask)

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(self.source.fingerprint.encode())
        digest.update(f"document:{self.documents.start}:{self.documents.stop}:{self.seq_len}:"
                      f"{self.pad_id}".encode())
        return digest.hexdigest()
