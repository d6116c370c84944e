"""Writing files so that a crash or power loss cannot leave a renamed file with unwritten data.

A rename is atomic, but not durable by itself: after a crash the new name can point at a file whose
data never reached the disk, and the rename itself can be lost. Databases therefore commit in a
fixed order, which every file megabeta writes follows (checkpoints, datasets, tokenizers, exports,
reports): write the data under a temporary name and fsync it, rename, fsync the directory that
holds the new name. Until the rename the old file, if any, stays whole under its name.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType


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


def fsync_directories(root: Path) -> None:
    """fsync every directory under `root` and `root` itself, deepest first: the entries of files
    that were written (and synced) inside them, by this process or another."""
    directories = [Path(d) for d, _, _ in os.walk(root)]
    for directory in sorted(directories, key=lambda d: len(d.parts), reverse=True):
        fsync_path(directory)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then its directories (`fsync_directories`): for a folder
    that another program wrote without syncing it."""
    for path in sorted(Path(root).rglob("*")):
        if path.is_file():
            fsync_path(path)
    fsync_directories(root)


def temporary_sibling(path: Path) -> Path:
    """Where `path`'s new contents are written before the rename: hidden, beside it (a rename
    stays within one file system), and named for this process so two writers never share one."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


class AtomicFiles:
    """Files that appear all at once: each of `finals` is written under its `temp` sibling, and
    `commit` syncs them all, then renames them in order (a reader that checks the last one sees
    the others complete). Leaving the ``with`` block removes whatever was not committed (after an
    error or an interrupt), so nothing half-written is ever found under a final name."""

    def __init__(self, finals: Sequence[str | os.PathLike]) -> None:
        self._temps = {Path(final): temporary_sibling(Path(final)) for final in finals}
        for final in self._temps:
            final.parent.mkdir(parents=True, exist_ok=True)

    def temp(self, final: str | os.PathLike) -> Path:
        """The temporary name to write `final`'s contents to."""
        return self._temps[Path(final)]

    def commit(self) -> None:
        for temp in self._temps.values():
            fsync_path(temp)
        for final, temp in self._temps.items():
            replace_durably(temp, final)

    def discard(self) -> None:
        for temp in self._temps.values():
            temp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFiles:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.discard()


def write_durably(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace `path` by `data` (a str is written as UTF-8) atomically and durably."""
    path = Path(path)
    with AtomicFiles([path]) as files:
        files.temp(path).write_bytes(data.encode() if isinstance(data, str) else data)
        files.commit()
