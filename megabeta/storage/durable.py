"""Writing files so that a crash or power loss cannot leave a renamed file with unwritten data.

A rename is atomic, but not durable by itself: after a crash the new name can point at a file whose
data never reached the disk, and the rename itself can be lost. Databases therefore commit in a
fixed order, which checkpoints follow (manager.py): write the data and fsync it, rename, fsync
the directory that holds the new name.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it before returning (the caller renames or fsyncs the
    directory that holds it)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_durably(source: Path, target: Path) -> None:
    """Rename `source` (synced already) to `target` and fsync the directory holding the name."""
    os.replace(source, target)
    fsync_path(target.parent)


def write_durably(path: Path, data: bytes) -> None:
    """Replace `path` by `data` atomically and durably: temporary file, fsync, rename, fsync."""
    tmp = path.with_name(path.name + ".tmp")
    write_synced(tmp, data)
    replace_durably(tmp, path)


def fsync_directories(root: Path) -> None:
    """fsync every directory under `root` and `root` itself, deepest first: the entries of files
    that were written (and synced) inside them, by this process or another."""
    directories = [Path(d) for d, _, _ in os.walk(root)]
    for directory in sorted(directories, key=lambda d: len(d.parts), reverse=True):
        fsync_path(directory)
