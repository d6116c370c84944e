"""The finished K/V history: what each block reads of the blocks before it (spec §2-§3).

Queries of block b at layer l read the finished K/V of their source layers m ∈ M(l) of the
tokens before start(b). One form serves training, evaluation and decoding alike:

- Storage. One key and one value buffer for every layer, `[L, B, H_kv, T, d_h]`, written once per
  (block, layer) cell (`write`). The group a block reads of source m is rows [lo, start) of
  layer m: a view, never rewritten. Rows at and after a block's start may hold anything (later
  blocks, or nothing yet): no reader looks there. A decode cache is the same buffers over its
  capacity (model/cache.py): the current block's finished K/V are written as soon as they exist
  and become visible when the next block starts.
- Views. A `HistoryView` is what a stack of cells reads: the buffers and the newest cell's first
  position as a 0-d tensor (a view of `positions`). Nothing in it is a Python number that
  differs between blocks, so one compiled unit or one kernel serves every block.
- Gradients. Readers see the buffers without autograd. In backward each reader adds its groups'
  key/value gradients into the gradient buffers (float32 even for a bf16 history), or leaves
  what a deferred kernel needs (`AttentionBackend.history_gradients`); the pass's driver reads a
  cell's rows after every later unit ran backward (model/passes.py): the order is the driver's,
  not autograd's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megabeta.kernels.history_attention import group_rows

Cell = tuple[int, int]
"""(block start, layer): whose finished K/V one write carries."""


class History:
    """The finished K/V of one pass or one decode cache (module doc).

    `sources[l]`: M(l); `window`: deep_token_window (0: off); `keys, values [L, B, H_kv, T, d_h]`;
    `gradient_dtype`: the gradient buffers' dtype where the pass runs backward (None: no
    backward; `KeyLayout.gradient_dtype`); `documents [B, T]`: each position's document start
    (spec §7), or None.
    """

    def __init__(self, sources: list[list[int]], window: int, keys: Tensor, values: Tensor, *,
                 gradient_dtype: torch.dtype | None = None,
                 documents: Tensor | None = None) -> None:
        self.sources, self.window = sources, window
        self.keys, self.values = keys, values
        self.documents = documents
        self.grad_keys: Tensor | None = None
        self.grad_values: Tensor | None = None
        if gradient_dtype is not None:
            self.grad_keys = torch.zeros(keys.shape, dtype=gradient_dtype, device=keys.device)
            self.grad_values = torch.zeros(keys.shape, dtype=gradient_dtype, device=keys.device)
        self.state: tuple[Tensor, ...] = ()
        """What the attention backend's readers leave for the history's gradients in backward
        (`AttentionBackend.prepare`): the gradient buffers, or what a deferred backend forms
        them from. Empty: no backward."""
        self.positions = torch.arange(keys.shape[3], device=keys.device)
        self.top = len(sources) - 1
        self._sources = tuple(tuple(s) for s in sources)

    @staticmethod
    def empty(sources: list[list[int]], window: int, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device, **kwargs: Any) -> "History":
        """A history of `shape` `[L, B, H_kv, T, d_h]` (contents undefined)."""
        return History(sources, window, torch.empty(shape, dtype=dtype, device=device),
                       torch.empty(shape, dtype=dtype, device=device), **kwargs)

    @property
    def length(self) -> int:
        return self.keys.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    def view(self, start: int) -> "HistoryView":
        """What a stack of cells whose newest starts at `start` reads."""
        return HistoryView(self.keys, self.values, self.grad_keys, self.grad_values, self.state,
                           self.positions[start], self._sources, self.window)

    def lower(self, start: int, n: int, cells: int = 1) -> Tensor | None:
        """The document bounds `[cells, B, n]` of `cells` consecutive blocks of n queries, the
        newest at `start` (a strided view); None without documents."""
        if self.documents is None:
            return None
        first = start - (cells - 1) * n
        rows = self.documents[:, first:first + n]
        step = n * self.documents.stride(1)
        return rows.as_strided((cells, *rows.shape), (step, *rows.stride()),
                               rows.storage_offset())

    def write(self, cells: list[Cell], keys: list[Tensor], values: list[Tensor]) -> None:
        """Write the finished K/V `[B, H_kv, n, d_h]` of `cells` (no autograd: their gradients
        come back through `gradient`)."""
        for (start, layer), k, v in zip(cells, keys, values):
            n = k.shape[2]
            self.keys[layer, :, :, start:start + n] = k
            self.values[layer, :, :, start:start + n] = v

    def gradient(self, cells: list[Cell], n: int) -> list[Tensor]:
        """The gradients of the finished K/V of `cells`, n rows each: keys then values, views of
        the gradient buffers (complete once every reader ran backward and the backend finished
        them, `AttentionBackend.history_gradients`)."""
        return [g[layer, :, :, start:start + n]
                for g in (self.grad_keys, self.grad_values) for start, layer in cells]


@dataclass(frozen=True)
class HistoryView:
    """What a stack of cells reads of a `History`: its buffers (and gradient buffers, None
    without backward) and the newest cell's first position as a 0-d int64 tensor on the
    buffers' device. Tensors and constants only, the same for every block of a pass but the
    start's value: a compiled unit reads one without a guard per block."""

    keys: Tensor
    values: Tensor
    grad_keys: Tensor | None
    grad_values: Tensor | None
    state: tuple[Tensor, ...]
    """The history's gradient state (`History.state`), which the readers' backward fills."""
    start: Tensor
    all_sources: tuple[tuple[int, ...], ...]
    window: int

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def top(self) -> int:
        return len(self.all_sources) - 1

    def sources(self, layer: int) -> list[int]:
        """M(layer)."""
        return list(self.all_sources[layer])

    def gradient_buffers(self) -> tuple[Tensor, Tensor] | None:
        """The history's gradient buffers (None: no backward): float32 where readers add into
        them, the history's dtype where the backend forms each row's once (`KeyLayout.deferred`)."""
        return None if self.grad_keys is None else (self.grad_keys, self.grad_values)


__all__ = ["Cell", "History", "HistoryView", "group_rows"]
