"""Outputs that appear all at once: written under temporary names, renamed when complete.

A run that fails or is interrupted leaves no file under a final name, so nothing half-written can
pass for a valid dataset or tokenizer; the temporary names start with a dot and end in ``.tmp-PID``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from megabeta.data.errors import DataError


class AtomicFiles:
    """Temporary siblings of ``finals``; :meth:`commit` renames them in order. Leaving the ``with``
    block removes whatever was not committed (after an error or an interrupt)."""

    def __init__(self, finals: Sequence[Path], overwrite: bool = False) -> None:
        for final in finals:
            if final.exists() and not overwrite:
                raise DataError(f"{final}: already exists; pass --overwrite to replace it or "
                                "choose another output name")
            final.parent.mkdir(parents=True, exist_ok=True)
        self._temps = {final: final.with_name(f".{final.name}.tmp-{os.getpid()}")
                       for final in finals}

    def temp(self, final: Path) -> Path:
        return self._temps[final]

    def commit(self) -> None:
        for temp in self._temps.values():
            with open(temp, "rb+") as stream:
                os.fsync(stream.fileno())
        for final, temp in self._temps.items():
            os.replace(temp, final)

    def discard(self) -> None:
        for temp in self._temps.values():
            temp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFiles:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.discard()
