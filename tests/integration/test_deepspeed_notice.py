"""Before DeepSpeed's first CPU run JIT-compiles `deepspeed_shm_comm` (half a minute or more, in
silence), rank 0 says what is being built, once (issue 19 §7)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from megabeta.engine import deepspeed_engine
from megabeta.engine.deepspeed_engine import SHM_OP, extensions_root, shm_build_notice


def test_notice_names_the_op_and_where_it_is_built_unless_cached(tmp_path: Path) -> None:
    notice = shm_build_notice(tmp_path)
    assert SHM_OP in notice and str(tmp_path / SHM_OP) in notice
    assert "may take a minute" in notice
    (tmp_path / SHM_OP).mkdir()
    (tmp_path / SHM_OP / f"{SHM_OP}.so").write_bytes(b"")
    assert shm_build_notice(tmp_path) is None


def test_extensions_root_follows_torch_extensions_dir(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert extensions_root().parent.name == "torch_extensions"


@pytest.mark.parametrize("pending", [True, False])
def test_announced_once_when_a_build_is_pending(pending: bool, tmp_path: Path,
                                                monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(deepspeed_engine, "_announced", False)
    monkeypatch.setattr(deepspeed_engine, "_shm_build_pending", lambda: pending)
    # A handler of our own on the "megabeta" logger: other tests' logging set-up (handlers,
    # propagation) must not change what is counted.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("megabeta")
    monkeypatch.setattr(logger, "level", logging.INFO)
    logger.addHandler(handler)
    try:
        deepspeed_engine.announce_shm_build()
        deepspeed_engine.announce_shm_build()
    finally:
        logger.removeHandler(handler)
    notices = [r for r in records if SHM_OP in r.getMessage()]
    assert len(notices) == (1 if pending else 0)
