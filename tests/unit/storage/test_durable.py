"""Files written atomically and durably: a crash or an error mid-write leaves the old file whole,
and the commit order is data fsynced, rename, directory fsynced."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megabeta.storage import durable
from megabeta.storage.durable import (AtomicFiles, fsync_tree, temporary_sibling,
                                      write_durably)
from support import REPO


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """os.fsync and os.replace recorded in order: ("fsync", path) and ("replace", src, dst)."""
    recorded: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        real_fsync(fd)
        recorded.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def replace(src, dst) -> None:
        real_replace(src, dst)
        recorded.append(("replace", os.fspath(src), os.fspath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return recorded


def test_write_durably_replaces_the_contents(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "f.txt"
    write_durably(path, "first\n")
    write_durably(path, b"\x00second")
    assert path.read_bytes() == b"\x00second"
    write_durably(path, "é\n")  # a str is written as UTF-8, newline untranslated
    assert path.read_bytes() == "é\n".encode()
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.txt"]  # no temporary left


def test_a_crash_mid_write_leaves_the_old_file(tmp_path: Path) -> None:
    """The process dies after writing the new data, before the commit: the old contents remain
    under the name (a write in place would have truncated them)."""
    path = tmp_path / "latest"
    path.write_text("old")
    crash = ("import os, sys\n"
             "from megabeta.storage.durable import write_durably\n"
             "os.fsync = lambda fd: os._exit(3)\n"
             "write_durably(sys.argv[1], 'new' * 100000)\n")
    done = subprocess.run([sys.executable, "-c", crash, str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert path.read_text() == "old"


def test_an_error_mid_write_leaves_the_old_files_and_no_temporary(tmp_path: Path) -> None:
    first, second = tmp_path / "a.bin", tmp_path / "b.json"
    first.write_text("old a")
    with pytest.raises(RuntimeError, match="interrupted"):
        with AtomicFiles([first, second]) as files:
            files.temp(first).write_text("new a")
            files.temp(second).write_text("new b")
            raise RuntimeError("interrupted")
    assert first.read_text() == "old a" and not second.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_data_synced_before_the_rename_and_the_directory_after(tmp_path: Path,
                                                                events: list[tuple]) -> None:
    path = tmp_path / "latest"
    write_durably(path, "step_00000003")
    temp = str(temporary_sibling(path))
    rename = events.index(("replace", temp, str(path)))
    assert ("fsync", temp) in events[:rename]
    assert ("fsync", str(tmp_path)) in events[rename + 1:]


def test_commit_renames_in_the_order_given(tmp_path: Path, events: list[tuple]) -> None:
    """A reader that checks the last file (a dataset's sidecar) finds the others complete."""
    finals = [tmp_path / "d.bin", tmp_path / "d.idx", tmp_path / "d.json"]
    with AtomicFiles(finals) as files:
        for final in finals:
            files.temp(final).write_text(final.suffix)
        files.commit()
    renamed = [e[2] for e in events if e[0] == "replace"]
    assert renamed == [str(f) for f in finals]
    last_rename = max(i for i, e in enumerate(events) if e[0] == "replace")
    synced = {e[1] for e in events[:events.index(("replace", str(files.temp(finals[0])),
                                                   str(finals[0])))] if e[0] == "fsync"}
    assert {str(files.temp(f)) for f in finals} <= synced  # every file synced before any rename
    assert ("fsync", str(tmp_path)) in events[last_rename + 1:]
    assert [f.read_text() for f in finals] == [".bin", ".idx", ".json"]


def test_fsync_tree_syncs_every_file_and_directory(tmp_path: Path, events: list[tuple]) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    written = [tmp_path / "top.txt", tmp_path / "a" / "mid.txt", tmp_path / "a" / "b" / "low"]
    for path in written:
        path.write_text("x")
    fsync_tree(tmp_path)
    synced = [e[1] for e in events if e[0] == "fsync"]
    assert set(synced) == {str(p) for p in [*written, tmp_path, tmp_path / "a",
                                             tmp_path / "a" / "b"]}
    assert synced.index(str(tmp_path)) == len(synced) - 1  # the root's entries last


def test_temporary_sibling_is_hidden_beside_the_file_and_per_process(tmp_path: Path) -> None:
    temp = temporary_sibling(tmp_path / "summary.png")
    assert temp.parent == tmp_path and temp.name == f".summary.png.tmp-{os.getpid()}"
    assert durable.temporary_sibling(tmp_path / "x") != durable.temporary_sibling(tmp_path / "y")
