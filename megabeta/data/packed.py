"""Fixed-length next-token samples packed across document boundaries.

The documents of a token range lie back to back in ``.bin``, each ending with EOS, so the range is
one stream. Sample ``i`` is ``stream[i·seq_len : i·seq_len + seq_len + 1]``: ``seq_len + 1`` tokens,
inputs ``[:-1]`` and targets ``[1:]``; consecutive samples share one boundary token so every token
of the stream is a target exactly once. The tail shorter than a sample is not used. Samples come
out as int64 arrays (a copy of ``seq_len + 1`` tokens, ready for an embedding lookup).
"""

from __future__ import annotations

import hashlib

import numpy as np

from megabeta.data.errors import DataError
from megabeta.data.indexed import IndexedDataset


class PackedDataset:
    """``len(self)`` samples of ``seq_len + 1`` tokens from ``source.tokens[start:end]``."""

    def __init__(self, source: IndexedDataset, seq_len: int,
                 token_range: tuple[int, int] | None = None, name: str = "") -> None:
        if seq_len < 1:
            raise DataError(f"seq_len {seq_len}: must be at least 1")
        start, end = (0, source.num_tokens) if token_range is None else token_range
        if not 0 <= start <= end <= source.num_tokens:
            raise DataError(f"{source.paths.bin}: token range [{start}, {end}) outside the "
                            f"{source.num_tokens} tokens of the dataset")
        available = end - start
        if available < seq_len + 1:
            part = f" ({name})" if name else ""
            raise DataError(f"{source.paths.bin}{part}: {available} tokens, fewer than one sample "
                            f"of seq_len + 1 = {seq_len + 1}; use a seq_len of at most "
                            f"{max(available - 1, 0)}, add data, or change the split")
        self.source = source
        self.seq_len = seq_len
        self.start, self.end = start, end
        self._length = (available - 1) // seq_len

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self._length:
            raise IndexError(f"sample {index} out of range for {self._length} samples")
        first = self.start + index * self.seq_len
        return self.source.tokens[first:first + self.seq_len + 1].astype(np.int64)

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(self.source.fingerprint.encode())
        digest.update(f"packed:{self.start}:{self.end}:{self.seq_len}".encode())
        return digest.hexdigest()
