"""A process holding a lock file the way torch's extension loader does (`FileBaton`: created
exclusively, held open while it builds or loads), alive or killed while holding it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_HOLD = ("import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); "
         "print('held', flush=True); time.sleep(120)")


def hold(lock: Path) -> subprocess.Popen:
    """A live process holding `lock` (the caller kills it)."""
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(lock)], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def killed_holding(lock: Path) -> None:
    """A loader SIGKILLed while it held `lock`: the file stays, nobody holds it."""
    child = hold(lock)
    child.kill()
    child.wait()
    assert lock.exists()
