"""The data tools' optional dependencies (``megabeta[hf]``, ``[parquet]``, ``[zstd]``), imported
where used, failing as a :class:`DataError` that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from megabeta.data.errors import DataError


def require_extra(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` of the optional extra ``extra``; DataError naming ``feature`` and the
    extra to install when it does not import (the message of :func:`megabeta.extras.require`).

    megabeta.extras is imported only on failure: it brings torch (its ConfigError), 1.4 s of
    start-up that the data tools never otherwise pay.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        from megabeta.extras import MissingExtra, require

        try:
            return require(module, extra, feature)
        except MissingExtra as err:
            raise DataError(str(err)) from None
