"""What a sample dataset hands out when its targets carry a loss mask.

A dataset whose tokens are all scored hands out plain int64 arrays of ``seq_len + 1`` tokens, as it
always has (the cheap path, no mask built). A dataset with a mask (``PREFIX.mask``, or
document-aligned samples whose padding is masked) hands out a :class:`MaskedSample` instead, and
says so with ``has_loss_mask``; the loader's collate turns its zeros into ``IGNORE_INDEX`` targets.

With ``data.document_mask`` a sample also carries the document id of each input position
(``documents``, spec §7), and its dataset says so with ``has_documents``; such datasets always hand
out :class:`MaskedSample` (all ones where nothing is masked).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MaskedSample:
    """``seq_len + 1`` tokens and their mask: ``mask[i] == 1`` when token ``i`` is a scored target
    (predicted from tokens ``0 … i-1``). ``mask[0]`` is carried along but never used: the first
    token of a sample is no target."""

    tokens: np.ndarray
    """int64 [seq_len + 1]"""
    mask: np.ndarray
    """uint8 [seq_len + 1]"""
    documents: np.ndarray | None = None
    """int32 [seq_len]: the document id of each input position ``tokens[:-1]``, non-decreasing,
    0 at position 0, one more at each document start (a run of block-alignment padding is a
    document of its own). Unique within the sample only: the model compares ids of one sample,
    never across samples. None when the dataset emits no ids."""

    @classmethod
    def all_scored(cls, tokens: np.ndarray) -> MaskedSample:
        """A sample of an unmasked dataset in a blend with masked ones: every target scored."""
        return cls(tokens, np.ones(len(tokens), dtype=np.uint8))


def has_loss_mask(dataset: object) -> bool:
    """Whether ``dataset`` hands out :class:`MaskedSample` items (datasets that predate masks
    and do not say are unmasked)."""
    return bool(getattr(dataset, "has_loss_mask", False))


def has_documents(dataset: object) -> bool:
    """Whether ``dataset``'s items carry document ids (:attr:`MaskedSample.documents`)."""
    return bool(getattr(dataset, "has_documents", False))


DOCUMENT_ID_DTYPE = np.int32
"""dtype of document ids: a sample of 2**31 tokens is far beyond any context, and half of int64
keeps the ids' copies to the device small."""


def segment_ids(starts: np.ndarray, first: int, length: int) -> np.ndarray:
    """Document ids of stream positions ``first … first + length - 1``: 0 at ``first``, one more
    at each of the sorted stream offsets ``starts`` inside the window (repeated offsets, the
    starts of empty documents, count once)."""
    low = np.searchsorted(starts, first, side="right")
    high = np.searchsorted(starts, first + length, side="left")
    marks = np.zeros(length, dtype=DOCUMENT_ID_DTYPE)
    marks[starts[low:high] - first] = 1
    return np.cumsum(marks, dtype=DOCUMENT_ID_DTYPE)
