"""Key/value caches for incremental decoding (spec §4.5).

Per layer, beta12 keeps finished KVs of completed blocks, construction KVs of the current block
and the current block's finished KVs that are computed but not yet visible ("pending"); when the
block completes the pending ones are appended to the finished buffer and the block buffers are
emptied. Memory per token per layer is therefore one K and one V (plus at most one block pending).
The standard and looped arms keep construction KVs only, one buffer per layer application.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


class KVBuffer:
    """An append-only `[B, H_kv, capacity, d_h]` pair of key and value buffers."""

    def __init__(self, batch: int, heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> None:
        end = self.length + k.shape[2]  # DecodeCache.reserve checked the capacity
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end

    def view(self, start: int = 0, end: int | None = None) -> tuple[Tensor, Tensor]:
        end = self.length if end is None else end
        return self.k[:, :, start:end], self.v[:, :, start:end]

    def clear(self) -> None:
        self.length = 0


@dataclass
class DecodeCache:
    """Decoding state of one batch of sequences: how many tokens were consumed, and the KVs."""

    position: int
    """Tokens consumed so far."""
    capacity: int
    """Most tokens this cache can hold."""
    construction: list[KVBuffer]
    """Per layer application: construction KVs (beta12: of the current block only)."""
    finished: list[KVBuffer] | None = None
    """beta12: per layer, finished KVs of all completed blocks."""
    pending: list[KVBuffer] | None = None
    """beta12: per layer, finished KVs of the current block, visible once it completes."""
    weights: tuple[tuple, Any] | None = None
    """The model's fused weights for decoding and the parameter state they were built from
    (`DecoderLM.decode_weights`)."""

    def reserve(self, count: int) -> None:
        """Check that `count` more tokens fit before any state is changed."""
        if self.position + count > self.capacity:
            raise ValueError(f"KV cache full: {self.position} + {count} tokens > capacity "
                             f"{self.capacity}; prefill with a larger capacity "
                             "(at most model.max_seq_len)")

    def memory_bytes(self) -> int:
        buffers = [*self.construction, *(self.finished or []), *(self.pending or [])]
        return sum(b.k.numel() * b.k.element_size() * 2 for b in buffers)
