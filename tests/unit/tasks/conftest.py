"""Task files of every variant (tests/support/tasks_helpers.py) and a tokenizer trained on them,
made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.corpus import train_tiny_tokenizer
from support.tasks_helpers import VARIANTS, make


@pytest.fixture(scope="session")
def files(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("tasks")
    return {name: make(tmp, name) for name in VARIANTS}


@pytest.fixture(scope="session")
def tokenizer(files, tmp_path_factory) -> Path:
    """A 320-piece tokenizer trained on the generated files through their `text` field, as
    users train one."""
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tasks_tok"), list(files.values()),
                                vocab_size=320)
