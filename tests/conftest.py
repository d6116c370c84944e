"""Session-wide fixtures: a tiny tokenized dataset shared by the training tests."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run under Triton's CPU interpreter where no GPU is present. `@triton.jit` reads
# the variable when a kernel is defined, so it is set before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from train_helpers import build_dataset


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(dataset prefix, tokenizer .model)."""
    return build_dataset(tmp_path_factory.mktemp("tiny_data"))
