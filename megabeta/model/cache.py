"""Key/value caches for incremental decoding (spec §4.5).

A beta12 cache is the training history's form (model/history.py) over the cache's capacity:
per layer the finished K/V of every token decoded so far, `[L, B, H_kv, capacity, d_h]`,
written as soon as a token has passed the layer; a query of the current block reads the rows
before the block's start only, so a token's finished K/V become visible when its block completes
(no "pending" copy). Beside it the current block's construction K/V, `[L, B, H_kv, c, d_h]`,
which its later tokens read (the in-block keys and the self slot). Memory per token and layer:
one K and one V, plus one block of construction K/V.

The standard and looped arms keep construction K/V only, one buffer per layer application over
the capacity (their "block" is the whole sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from megabeta.model.history import History


@dataclass
class DecodeCache:
    """Decoding state of one batch of sequences (one document each): how many tokens were
    consumed, and their K/V."""

    position: int
    """Tokens consumed so far."""
    capacity: int
    """Most tokens this cache can hold."""
    construction_k: Tensor
    """`[applications, B, H_kv, c, d_h]`: construction keys of the current block (beta12) or of
    every token (the control arms, c = capacity)."""
    construction_v: Tensor
    history: History | None = None
    """beta12: every layer's finished K/V (module doc)."""
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
        tensors = [self.construction_k, self.construction_v]
        if self.history is not None:
            tensors += [self.history.keys, self.history.values]
        return sum(t.numel() * t.element_size() for t in tensors)


__all__ = ["DecodeCache"]
