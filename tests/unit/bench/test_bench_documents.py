"""The document-mask benchmark's pure parts (megabeta.bench.documents): how much of the finished
groups' work the mask skips, counted by hand on small samples, and the packed documents."""

from __future__ import annotations

import pytest
import torch

from megabeta.bench.documents import masked_share, packed_documents, skipped_share
from megabeta.model.documents import document_starts


def _starts(ids: list[list[int]]) -> torch.Tensor:
    t = torch.tensor(ids)
    return document_starts(t, t)


def test_a_block_wholly_in_a_later_document_skips_the_rows_before_it() -> None:
    # c = 4: block 1 (positions 4-7) reads rows 0-3 unmasked; all its queries are in the
    # document from 3: 3 of 4 rows skipped, for every query.
    starts = _starts([[0, 0, 0, 1, 1, 1, 1, 1]])
    assert skipped_share(starts, 4) == masked_share(starts, 4) == 12 / 16


def test_a_block_that_starts_in_an_earlier_document_skips_nothing_but_masks_rows() -> None:
    # Block 1's first query is in the document from 0: its smallest bound is 0, so the kernels
    # skip nothing; row by row the other three queries (document from 5) mask all 4 rows.
    starts = _starts([[0, 0, 0, 0, 0, 1, 1, 1]])
    assert skipped_share(starts, 4) == 0.0
    assert masked_share(starts, 4) == 12 / 16


def test_shares_over_a_batch_and_several_blocks() -> None:
    # c = 2, T = 6: blocks at 2 and 4 read 2 and 4 rows per query (12 per sample).
    starts = _starts([[0, 0, 0, 0, 0, 0],  # one document: nothing skipped
                      [0, 1, 1, 2, 2, 2]])  # bounds: block 2 -> (1, 3) min 1; block 4 -> 3, 3
    assert skipped_share(starts, 2) == pytest.approx((1 * 2 + 3 * 2) / 24)
    assert masked_share(starts, 2) == pytest.approx((1 + 2 + 3 + 3) / 24)
    assert skipped_share(starts, 6) == masked_share(starts, 6) == 0.0  # one block: no groups


def test_packed_documents_are_contiguous_and_of_the_given_lengths() -> None:
    ids = packed_documents(3, 100, 5, 9, seed=1)
    assert ids.shape == (3, 100)
    flat = ids.flatten()
    assert bool((flat[1:] - flat[:-1] >= 0).all())
    lengths = torch.unique_consecutive(flat, return_counts=True)[1]
    assert bool(((lengths[:-1] >= 5) & (lengths[:-1] <= 9)).all())  # the last one is cut
    assert torch.equal(ids, packed_documents(3, 100, 5, 9, seed=1))
