"""The train/validation split (megabeta/data/split.py): by whole documents."""

from __future__ import annotations

import pytest

from megabeta.data import DataError, split_documents


def test_split_by_document_ranges(dataset):
    train, val = split_documents(10, 0.25)
    assert (train, val) == (range(0, 7), range(7, 10))
    assert split_documents(10, 0.0) == (range(0, 10), range(10, 10))
    start, middle = dataset.document_token_range(train.start, train.stop)
    middle_again, end = dataset.document_token_range(val.start, val.stop)
    assert start == 0 and middle == middle_again == sum([5, 9, 3, 12, 7, 4, 8])
    assert end == dataset.num_tokens
    with pytest.raises(DataError, match="leave none for training"):
        split_documents(3, 0.9)
    with pytest.raises(DataError, match=r"must be in \[0, 1\)"):
        split_documents(3, 1.0)
