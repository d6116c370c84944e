"""Progress over input bytes (MB/s) with documents/s alongside, on stderr when it is a terminal."""

from __future__ import annotations

import sys
import time
from types import TracebackType

from tqdm import tqdm


class ByteProgress:
    """A tqdm bar over on-disk input bytes; off with ``quiet`` or when stderr is not a TTY."""

    def __init__(self, total_bytes: int, description: str, quiet: bool) -> None:
        self._bar = tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True,
                         unit_divisor=1000, file=sys.stderr, dynamic_ncols=True,
                         disable=quiet or not sys.stderr.isatty())
        self._started = time.monotonic()
        self.documents = 0

    @property
    def shown(self) -> bool:
        return not self._bar.disable

    def advance(self, nbytes: int, documents: int = 0) -> None:
        self.documents += documents
        if documents and not self._bar.disable:
            elapsed = max(time.monotonic() - self._started, 1e-9)
            self._bar.set_postfix_str(f"{self.documents / elapsed:,.0f} docs/s", refresh=False)
        self._bar.update(nbytes)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
