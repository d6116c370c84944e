"""C++ extensions that torch JIT-builds on first use (megabeta's CPU attention kernels,
DeepSpeed's CPU communication op): where they are built, and the build folder's lock.

`torch.utils.cpp_extension.load` creates `<build folder>/lock` exclusively each time a process
loads an extension, built or not, and deletes it when done. A process killed in between (a
preemption's SIGKILL, a job's time limit, a launcher tearing its ranks down) leaves the file
behind, and every later load on that machine waits on it forever, printing nothing. So
megabeta's loaders go through `build_lock`: an advisory lock of their own (`flock`, which the
kernel releases when its holder dies) taken around torch's, under which a torch lock that no
live process holds open is left over from a dead one and is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TORCH_LOCK = "lock"
"""torch's lock file in a build folder (`torch.utils.file_baton.FileBaton`)."""

OWN_LOCK = "megabeta.flock"
"""The advisory lock megabeta's loaders hold around torch's, in the same folder."""


def extensions_root() -> Path:
    """Where torch.utils.cpp_extension builds JIT extensions: $TORCH_EXTENSIONS_DIR, else
    <cache>/torch_extensions/py<version>_<accelerator> (torch's own rule)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[Path]:
    """Hold extension `name`'s build folder (yielded) for one `load`: megabeta's loaders take
    turns, and a torch lock left by a process that died while loading is removed first."""
    folder = extensions_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / OWN_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            remove_stale_lock(folder)
            yield folder
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def remove_stale_lock(folder: Path) -> bool:
    """Delete `folder`'s torch lock if no live process holds it open (torch keeps the lock
    file open while it builds or loads); True when one was deleted. Where that cannot be
    told (no /proc, a lock of another user), the lock stays and a warning says what to do."""
    lock = folder / TORCH_LOCK
    if not lock.exists():
        return False
    holders = lock_holders(lock)
    if holders is None:
        log.warning("megabeta: %s exists and whether a live process holds it cannot be told "
                    "here; loading %s waits until it is gone: if no build of it is running, "
                    "delete it", lock, folder.name)
        return False
    if holders:
        return False  # a live load: torch waits for it
    with contextlib.suppress(FileNotFoundError):  # another loader (not megabeta's) was faster
        lock.unlink()
        log.warning("megabeta: removed %s, left by a process that died while loading %s "
                    "(every later load would have waited on it)", lock, folder.name)
        return True
    return False


def lock_holders(path: Path) -> list[int] | None:
    """The processes holding `path` open (from /proc), or None where that cannot be told."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    try:
        if os.getuid() != 0 and path.stat().st_uid != os.getuid():
            return None  # another user's process: its descriptors are not ours to read
    except FileNotFoundError:
        return []
    target = os.path.realpath(path)
    holders = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            descriptors = os.listdir(entry / "fd")
        except OSError:  # gone, or not ours
            continue
        for descriptor in descriptors:
            try:
                if os.readlink(entry / "fd" / descriptor) == target:
                    holders.append(int(entry.name))
                    break
            except OSError:
                continue
    return holders
