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

:class:`BlockAlignedDataset` (``data.align = "block"``) packs documents so that each starts at a
multiple of the model's block size ``c`` (spec §7: then, under the document mask, each document's
logits equal those of the document run alone). The gap after a document is padding: its
positions are masked from the loss (as targets, and as the inputs that predict the next
document's first token) and form a document of their own. A document longer than the room left
in a sample goes on at position 0 of the next, as packed ones do.

With ``document_ids`` (``data.document_mask``) every dataset adds the document id of each input
position to its samples (:attr:`MaskedSample.documents`).
"""

from __future__ import annotations

import hashlib

import numpy as np

from megabeta.data.errors import DataError
from megabeta.data.indexed import IndexedDataset
from megabeta.data.sample import DOCUMENT_ID_DTYPE, MaskedSample, segment_ids


class PackedDataset:
    """``len(self)`` samples of ``seq_len + 1`` tokens from ``source.tokens[start:end]``;
    ``document_ids``: with the id of each input position's document, from the ``.idx``."""

    def __init__(self, source: IndexedDataset, seq_len: int,
                 token_range: tuple[int, int] | None = None, name: str = "",
                 document_ids: bool = False) -> None:
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
        self.has_documents = document_ids
        self.has_loss_mask = source.has_loss_mask or document_ids

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> np.ndarray | MaskedSample:
        if not 0 <= index < self._length:
            raise IndexError(f"sample {index} out of range for {self._length} samples")
        first = self.start + index * self.seq_len
        stop = first + self.seq_len + 1
        tokens = self.source.tokens[first:stop].astype(np.int64)
        if not self.has_loss_mask:
            return tokens
        mask = (np.ones(len(tokens), dtype=np.uint8) if self.source.loss_masks is None
                else np.array(self.source.loss_masks[first:stop]))
        documents = (segment_ids(self.source.document_starts, first, self.seq_len)
                     if self.has_documents else None)
        return MaskedSample(tokens, mask, documents)

    @property
    def fingerprint(self) -> str:
        return _fingerprint(self.source, f"packed:{self.start}:{self.end}:{self.seq_len}")


class DocumentDataset:
    """Samples of ``seq_len + 1`` tokens, one per document of ``documents`` (a range of
    ``source``'s documents; default all), each from the document's first token, padded with
    ``pad_id`` past the document's end and masked there. A document longer than one sample is
    left out and counted (``dropped``): its continuation would start mid-document without its
    premises (a task's program without its assignments), so its scored targets could not be
    predicted from what the sample holds. Documents of one token have no target and give no
    sample. Items are always :class:`MaskedSample` (the padding needs a mask); where the
    source has a mask it masks the document's own targets too.

    The padding id is irrelevant to the loss: a causal model's outputs at a document's positions
    do not depend on the tokens after it, and the padded targets are not scored."""

    has_loss_mask = True

    def __init__(self, source: IndexedDataset, seq_len: int, documents: range | None = None,
                 name: str = "", pad_id: int = 0, document_ids: bool = False) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len {seq_len}: must be at least 1")
        documents = _document_range(source, documents)
        # Token offsets of the documents' starts, and of the end of the last one.
        starts = source.document_starts[documents.start:documents.stop + 1]
        lengths = np.diff(starts)
        fits = lengths <= seq_len + 1
        self.dropped = int((~fits).sum())
        """Documents longer than one sample (``seq_len + 1`` tokens), left out."""
        self.longest = int(lengths.max()) if len(lengths) else 0
        owner = np.flatnonzero(fits & (lengths >= 2))
        if len(owner) == 0:
            part = f" ({name})" if name else ""
            raise DataError(f"{source.paths.bin}{part}: no document of 2 to seq_len + 1 = "
                            f"{seq_len + 1} tokens ({self.dropped} longer, the longest "
                            f"{self.longest}), so no sample; raise data.seq_len, add data, "
                            "change the split, or use data.align = \"packed\"")
        self.source = source
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.documents = documents
        self.has_documents = document_ids
        self._starts = starts[owner]
        self._ends = starts[owner + 1]

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def padding_share(self) -> float:
        """Share of the samples' input positions that are padding (their compute is wasted)."""
        real = np.minimum(self._ends - self._starts, self.seq_len).sum()
        return 1.0 - float(real) / (len(self._starts) * self.seq_len)

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
        ids = None
        if self.has_documents:  # the document, then its padding as a document of its own
            ids = (np.arange(self.seq_len) >= stop - first).astype(DOCUMENT_ID_DTYPE)
        return MaskedSample(tokens, mask, ids)

    @property
    def fingerprint(self) -> str:
        return _fingerprint(self.source, f"whole-document:{self.documents.start}:"
                            f"{self.documents.stop}:{self.seq_len}:{self.pad_id}")


class BlockAlignedDataset:
    """Samples of ``seq_len + 1`` tokens of the documents ``documents`` of ``source`` (default
    all) laid out on a stream where each document starts at a multiple of ``block`` (spec §7),
    the gaps filled with ``pad_id``; sample ``i`` is ``stream[i·seq_len : i·seq_len + seq_len
    + 1]``, as in :class:`PackedDataset`. ``seq_len`` must be a multiple of ``block``, so a
    multiple of ``block`` in the stream is one in every sample. Items are :class:`MaskedSample`
    with document ids: each document, and each run of padding, has its own id.

    A target is scored when it and the input predicting it are document tokens (and the source's
    mask scores it): a pad is never a target, and neither is a document's first token when
    padding precedes it (predicting it from padding would learn nothing). Where a document ends
    on a block boundary the next one follows at once, and its first token is a target of the
    previous document's EOS, as in packed samples."""

    has_loss_mask = True
    has_documents = True

    def __init__(self, source: IndexedDataset, seq_len: int, block: int,
                 documents: range | None = None, name: str = "", pad_id: int = 0) -> None:
        if block < 1 or seq_len < 1 or seq_len % block:
            raise DataError(f"seq_len {seq_len} and block size {block}: block-aligned samples "
                            "need seq_len a positive multiple of the block size; change "
                            "data.seq_len or model.block_size")
        documents = _document_range(source, documents)
        starts = source.document_starts[documents.start:documents.stop + 1]
        lengths = np.diff(starts)
        # Document d sits at stream offset offsets[d]: every document takes whole blocks.
        offsets = np.concatenate(([0], np.cumsum(-(-lengths // block) * block)))
        used = int(offsets[-2] + lengths[-1]) if len(lengths) else 0  # no padding after the last
        if used < seq_len + 1:
            part = f" ({name})" if name else ""
            raise DataError(f"{source.paths.bin}{part}: {used} tokens once block-aligned, fewer "
                            f"than one sample of seq_len + 1 = {seq_len + 1}; lower data.seq_len, "
                            "add data, or change the split")
        self.source = source
        self.seq_len = seq_len
        self.block = block
        self.pad_id = pad_id
        self.documents = documents
        self._starts, self._lengths, self._offsets = starts[:-1], lengths, offsets[:-1]
        pad_starts = (offsets[:-1] + lengths)[lengths % block != 0]
        self._segment_starts = np.sort(np.concatenate((offsets[:-1], pad_starts)))
        self._length = (used - 1) // seq_len

    @property
    def padding_share(self) -> float:
        """Share of the samples' input positions that are padding (their compute is wasted)."""
        inputs = self._length * self.seq_len
        real = np.clip(inputs - self._offsets, 0, self._lengths).sum()
        return 1.0 - float(real) / inputs

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> MaskedSample:
        if not 0 <= index < self._length:
            raise IndexError(f"sample {index} out of range for {self._length} samples")
        first = index * self.seq_len
        position = first + np.arange(self.seq_len + 1)
        owner = np.searchsorted(self._offsets, position, side="right") - 1
        within = position - self._offsets[owner]
        real = within < self._lengths[owner]
        source_at = self._starts[owner[real]] + within[real]
        tokens = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        tokens[real] = self.source.tokens[source_at]
        scored = real.copy()
        scored[1:] &= real[:-1]
        if self.source.loss_masks is not None:
            scored[real] &= self.source.loss_masks[source_at] != 0
        return MaskedSample(tokens, scored.astype(np.uint8),
                            segment_ids(self._segment_starts, first, self.seq_len))

    @property
    def fingerprint(self) -> str:
        return _fingerprint(self.source, f"block:{self.documents.start}:{self.documents.stop}:"
                            f"{self.seq_len}:{self.block}:{self.pad_id}")


def _fingerprint(source: IndexedDataset, samples: str) -> str:
    """What a resume compares: the source's fingerprint and how its samples are cut."""
    digest = hashlib.sha256(source.fingerprint.encode())
    digest.update(samples.encode())
    return digest.hexdigest()


def _document_range(source: IndexedDataset, documents: range | None) -> range:
    """``documents`` (default: all of ``source``'s), checked to lie within the dataset."""
    documents = range(source.num_documents) if documents is None else documents
    if not 0 <= documents.start <= documents.stop <= source.num_documents:
        raise DataError(f"{source.paths.bin}: documents [{documents.start}, "
                        f"{documents.stop}) outside the {source.num_documents} documents")
    return documents
