"""A run's data (megabeta/data/build.py): validation documents kept out of training, several
datasets blended by weight."""

from __future__ import annotations

import numpy as np
import pytest
from support.data_helpers import write_dataset

from megabeta.data import BlendedDataset, DataError, build_train_val


def test_build_train_val_keeps_validation_documents_out_of_training(tmp_path):
    prefix = write_dataset(tmp_path / "ds", [40] * 20)
    data = build_train_val([prefix], seq_len=16, val_fraction=0.1)
    assert (data.train.start, data.train.end) == (0, 18 * 40)
    assert (data.val.start, data.val.end) == (18 * 40, 20 * 40)
    assert data.vocab_size == 1000 and data.tokenizer_sha256 == "abc"
    assert data.special_ids == {"pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3}
    assert build_train_val([prefix], seq_len=16).val is None


def test_build_train_val_blends_several_datasets(tmp_path):
    prefixes = [write_dataset(tmp_path / f"d{j}", [33] * 30, first_id=50 * j) for j in range(2)]
    data = build_train_val(prefixes, weights=[3, 1], seq_len=8, val_fraction=0.1)
    assert isinstance(data.train, BlendedDataset) and isinstance(data.val, BlendedDataset)
    share = np.bincount(data.train.dataset_index, minlength=2) / len(data.train)
    assert abs(share[0] - 0.75) < 0.01
    with pytest.raises(DataError, match="2 weights for 1 datasets"):
        build_train_val(prefixes[:1], weights=[1, 2], seq_len=8)
