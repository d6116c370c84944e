"""Session-wide fixtures: a tiny tokenized dataset shared by the training tests."""

from __future__ import annotations

import pytest

from train_helpers import build_dataset


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(dataset prefix, tokenizer .model)."""
    return build_dataset(tmp_path_factory.mktemp("tiny_data"))
