"""Blending (megabeta/data/blend.py): every prefix of the schedule follows the weights, the
blend serves each dataset's samples without repeats, and its fingerprint names the weights."""

from __future__ import annotations

import numpy as np
import pytest
from support.data_helpers import write_dataset

from megabeta.data import BlendedDataset, DataError, IndexedDataset, PackedDataset, blend_schedule


def test_blend_follows_the_weights(tmp_path):
    weights = [0.5, 0.3, 0.2]
    owner, local = blend_schedule(weights, 10000)
    counts = np.bincount(owner, minlength=3)
    assert np.all(np.abs(counts - np.array(weights) * 10000) <= 1)
    for n in (1, 7, 100, 333, 4321):  # every prefix is close, not only the whole
        prefix_counts = np.bincount(owner[:n], minlength=3)
        assert np.all(np.abs(prefix_counts - np.array(weights) * n) < 3)
    for j in range(3):  # each dataset's samples in order, none skipped
        assert np.array_equal(local[owner == j], np.arange(counts[j]))


def test_blended_dataset_serves_the_right_samples_without_repeats(tmp_path):
    parts = [PackedDataset(IndexedDataset(write_dataset(tmp_path / f"d{j}", [30] * n,
                                                        first_id=100 * j)), seq_len=10)
             for j, n in enumerate([10, 4])]
    blend = BlendedDataset(parts, weights=[0.5, 0.5])
    pairs = list(zip(blend.dataset_index.tolist(), blend.dataset_sample_index.tolist()))
    assert len(set(pairs)) == len(pairs) == len(blend)
    assert sum(1 for j, _ in pairs if j == 1) == len(parts[1])  # ends when the smaller runs out
    for i, (j, k) in enumerate(pairs):
        assert np.array_equal(blend[i], parts[j][k])
    by_size = BlendedDataset(parts)
    counts = np.bincount(by_size.dataset_index, minlength=2)
    assert abs(counts[0] / counts.sum() - len(parts[0]) / (len(parts[0]) + len(parts[1]))) < 0.05
    with pytest.raises(DataError, match="one weight per dataset"):
        BlendedDataset(parts, weights=[1.0])
    with pytest.raises(DataError, match="positive finite weight"):
        BlendedDataset(parts, weights=[1.0, 0.0])


def test_blended_fingerprint_changes_with_weights(tmp_path):
    parts = [PackedDataset(IndexedDataset(write_dataset(tmp_path / f"d{j}", [30] * 10)), 8)
             for j in range(2)]
    assert BlendedDataset(parts, [1, 1]).fingerprint != BlendedDataset(parts, [2, 1]).fingerprint
    assert BlendedDataset(parts, [1, 1]).fingerprint == BlendedDataset(parts, [1, 1]).fingerprint
