"""The one exception type for bad data: the message names the file, field or flag and the fix."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


class DataError(ValueError):
    """Bad input data, a damaged or mismatched dataset, or an option the data cannot satisfy.

    Command-line tools print the message as ``error: ...`` and exit with status 2; library callers
    catch it like any ``ValueError``.
    """


def refuse_existing(paths: Iterable[Path], overwrite: bool, choose: str = "another output name"
                    ) -> None:
    """DataError naming the first of `paths` that exists, unless the command was told
    `--overwrite`; `choose` names what to change instead."""
    if overwrite:
        return
    for path in paths:
        if path.exists():
            raise DataError(f"{path}: already exists; pass --overwrite to replace it or choose "
                            f"{choose}")
