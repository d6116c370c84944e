"""Task files (megabeta/tasks/make.py) are deterministic per seed: one generator drawn in order."""

from __future__ import annotations

import pytest
from support.tasks_helpers import VARIANTS, make


@pytest.mark.parametrize("name", VARIANTS)
def test_same_seed_same_bytes_other_seed_other_bytes(files, tmp_path, name):
    again = make(tmp_path, name)
    assert again.read_bytes() == files[name].read_bytes()
    assert make(tmp_path, name, seed=2).read_bytes() != files[name].read_bytes()
    # One generator drawn in order: a shorter file is the start of a longer one.
    shorter = make(tmp_path, name, count=40).read_bytes()
    assert files[name].read_bytes().startswith(shorter)
