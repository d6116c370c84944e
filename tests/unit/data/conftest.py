"""A small dataset of ten documents of known lengths (tests/support/data_helpers.py)."""

from __future__ import annotations

import pytest
from support.data_helpers import write_dataset

from megabeta.data import IndexedDataset


@pytest.fixture
def dataset(tmp_path) -> IndexedDataset:
    return IndexedDataset(write_dataset(tmp_path / "ds", [5, 9, 3, 12, 7, 4, 8, 6, 10, 11]))
