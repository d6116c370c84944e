"""Before DeepSpeed's first CPU run JIT-compiles `deepspeed_shm_comm` (half a minute or more, in
silence), rank 0 says what is being built, once (issue 19 §7); the engine loads it past a lock
that a killed rank left."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megabeta.engine import deepspeed_engine
from megabeta.engine.deepspeed_engine import SHM_OP, shm_build_notice
from megabeta.kernels.jit_build import OWN_LOCK, TORCH_LOCK, extensions_root
from support.lock_holder import killed_holding


def test_notice_names_the_op_and_where_it_is_built_unless_cached(tmp_path: Path) -> None:
    notice = shm_build_notice(tmp_path)
    assert SHM_OP in notice and str(tmp_path / SHM_OP) in notice
    assert "may take a minute" in notice
    (tmp_path / SHM_OP).mkdir()
    (tmp_path / SHM_OP / f"{SHM_OP}.so").write_bytes(b"")
    assert shm_build_notice(tmp_path) is None


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


@pytest.mark.slow
def test_the_op_loads_past_a_lock_a_killed_rank_left(tmp_path: Path) -> None:
    """A rank killed while it loaded the op left torch's lock in the op's build folder: the
    engine's `load_shm_op` removes it and loads the op for `deepspeed.initialize`, where torch's
    loader alone would wait on it forever."""
    pytest.importorskip("deepspeed")
    root = tmp_path / "extensions"
    cached = extensions_root() / SHM_OP
    if (cached / f"{SHM_OP}.so").is_file():  # else the child builds it (a minute or more)
        shutil.copytree(cached, root / SHM_OP, ignore=shutil.ignore_patterns(TORCH_LOCK, OWN_LOCK))
    lock = root / SHM_OP / TORCH_LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    killed_holding(lock)
    script = ("from megabeta.engine.deepspeed_engine import SHM_OP, load_shm_op\n"
              "from deepspeed.ops.op_builder.builder import OpBuilder\n"
              "load_shm_op(); print(SHM_OP in OpBuilder._loaded_ops)\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "True", done.stdout + done.stderr
    assert str(lock) in done.stderr and not lock.exists()
