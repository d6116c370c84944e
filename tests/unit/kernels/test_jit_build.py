"""The JIT-built extensions' cache and lock (megabeta/kernels/jit_build.py): torch's build
folder, a torch lock left by a dead loader removed and one a live loader holds kept, megabeta's
loaders taking turns, and the CPU kernels loading past a lock that a killed run left."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from megabeta.kernels import cpu_attention, jit_build
from megabeta.kernels.jit_build import OWN_LOCK, TORCH_LOCK, build_lock, extensions_root
from support.lock_holder import hold, killed_holding

def test_extensions_root_is_torchs_build_root(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "env"))
    assert extensions_root() == tmp_path / "env"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(torch.utils.cpp_extension, "get_default_build_root",
                        lambda: str(tmp_path / "cache"))
    torchs = torch.utils.cpp_extension._get_build_directory("probe", False)
    assert extensions_root() / "probe" == Path(torchs)


def test_a_lock_a_dead_loader_left_is_removed_and_named(tmp_path: Path, monkeypatch,
                                                        caplog) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "ext" / TORCH_LOCK
    lock.parent.mkdir()
    killed_holding(lock)
    with caplog.at_level(logging.WARNING, logger=jit_build.__name__):
        with build_lock("ext") as folder:
            assert folder == lock.parent
            assert not lock.exists()
    assert any(str(lock) in r.getMessage() and "died" in r.getMessage() for r in caplog.records)


def test_a_lock_a_live_loader_holds_stays(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "ext" / TORCH_LOCK
    lock.parent.mkdir()
    child = hold(lock)
    try:
        assert jit_build.lock_holders(lock) == [child.pid]
        with build_lock("ext"):
            assert lock.exists()
    finally:
        child.kill()
        child.wait()
    assert jit_build.lock_holders(lock) == []
    assert jit_build.remove_stale_lock(lock.parent) and not lock.exists()


def test_megabetas_loaders_take_turns(tmp_path: Path) -> None:
    inside = ("import sys; from megabeta.kernels.jit_build import build_lock\n"
              "with build_lock('ext'):\n    print('in', flush=True); sys.stdin.read()\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    child = subprocess.Popen([sys.executable, "-c", inside], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline().strip() == "in"
    with open(tmp_path / "ext" / OWN_LOCK, "a") as handle:
        with pytest.raises(BlockingIOError):
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        child.stdin.close()
        assert child.wait(timeout=60) == 0
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when its holder ended


@pytest.mark.skipif(not cpu_attention.build(), reason="the C++ kernels cannot be built here")
def test_the_cpu_kernels_load_past_a_lock_a_killed_run_left(tmp_path: Path) -> None:
    """Before `build_lock`, torch's loader waited on such a lock forever."""
    name = cpu_attention.build_name()
    root = tmp_path / "extensions"
    # This process's build, copied: the child finds it built (or builds it again, slower).
    shutil.copytree(extensions_root() / name, root / name,
                    ignore=shutil.ignore_patterns(TORCH_LOCK, OWN_LOCK))
    lock = root / name / TORCH_LOCK
    killed_holding(lock)
    done = subprocess.run(
        [sys.executable, "-c", "from megabeta.kernels import cpu_attention as c; "
         "print(c.build())"],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "True", done.stdout + done.stderr
    assert str(lock) in done.stderr and not lock.exists()
