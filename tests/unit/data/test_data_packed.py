"""Packing (megabeta/data/packed.py): fixed-length samples that cover the token stream across
documents."""

from __future__ import annotations

import numpy as np
import pytest
from support.data_helpers import EOS

from megabeta.data import PackedDataset


def test_packed_samples_cover_the_stream_across_documents(dataset):
    packed = PackedDataset(dataset, seq_len=8)
    stream = np.asarray(dataset.tokens, dtype=np.int64)
    assert len(packed) == (dataset.num_tokens - 1) // 8
    for i in range(len(packed)):
        sample = packed[i]
        assert sample.dtype == np.int64 and sample.shape == (9,)
        assert np.array_equal(sample, stream[8 * i:8 * i + 9])
        if i:
            assert sample[0] == packed[i - 1][-1]  # each target token appears exactly once
    assert any(EOS in packed[i][1:-1] for i in range(len(packed)))  # crosses document ends
    with pytest.raises(IndexError):
        packed[len(packed)]
