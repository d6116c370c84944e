"""The finished-KV history of one forward pass: what each block reads of the blocks before it.

Spec §3: queries of block b at layer l read the finished KVs of the source layers m ∈ M(l) of all
tokens before start(b). Two ways to hand them to attention live here:

`PieceHistory` keeps, per source layer, a list of per-block tensors and gives attention the pieces
(`PieceView`); the key set is concatenated per (block, layer). It serves the explicit attention
path and, built over the decode cache, decoding.

`BufferedHistory` is the training path of fused attention. Concatenating a growing history for
every (block, layer) copies O(T²/c) numbers per forward, and under autograd each copy is kept for
backward (design notes, "The block loop"); at c = 32 those copies cost more than the attention.
Instead:

- Layout. One key and one value buffer per READER layer l, `[B, H_kv, T·G_l, width]` with
  G_l = |M(l)|, token-major: the finished KV of slot g (source m = M(l)[g]) of token t is row
  t·G_l + g. Each finished KV is written G-fold (once per reader, O(T·ΣG_l) in all), and the
  history before any block start S is rows [0, S·G_l): a view, no copy. The block's own keys (the
  sink and in-block keys of attention.py) are written right behind it, rows [S·G_l, S·G_l + n),
  the "tail", so one SDPA call over `buffer[:, :, :S·G_l + n]` reads the whole key set. Key order
  does not matter to softmax, and each key's depth column (attention.py) carries its source layer.
- Tail rows. They are the rows block b's own finished KVs take once the block is done
  (`_Publish`, after the block's last reader). In backward a reader rewrites its tail before use,
  which is only allowed once no later block needs block b's finished rows: checked, not assumed.
- Gradients. Readers run SDPA on detached views, so autograd has no edge from them to the
  finished-KV producers. `_ReadHistory` adds the gradient of a reader's history rows into one
  gradient buffer per SOURCE layer `[B, H_kv, T, width]`; `_Publish` of block b hands block b's rows
  to the producers in its backward.
- Ordering comes from autograd itself. `_Publish` of block b returns an anchor tensor that every
  reader of block b+1 takes as input, so its backward runs after theirs; theirs run after
  `_Publish` of block b+1 (their outputs flow into block b+1's finished KVs), and so on. When
  block b's gradient is handed out, every later reader has added to it, and when a block is
  recomputed (activation checkpointing), no later block needs its rows any more.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

from megabeta.model.attention import KeyLayout, KeySet, sdpa

History = list[tuple[Tensor, ...]]
"""Per source layer m, the finished K (or V) pieces covering tokens 0 … start(block)-1, in order."""


def _tail(pieces: tuple[Tensor, ...], keep: int) -> list[Tensor]:
    """The last `keep` tokens of a history given as pieces `[B, H, len, d_h]`."""
    out: list[Tensor] = []
    for piece in reversed(pieces):
        if keep <= 0:
            break
        length = piece.shape[2]
        out.append(piece if length <= keep else piece[:, :, length - keep:])
        keep -= length
    return out[::-1]


@dataclass
class PieceView:
    """What one block reads, as per-block pieces per source layer (plus, when decoding, the
    construction KVs of the block's tokens before the current ones)."""

    sources: list[list[int]]
    """M(l) per layer l."""
    window: int
    """deep_token_window (0 = off)."""
    block_start: int
    keys: History
    values: History
    prefix: list[tuple[Tensor, Tensor]] | None = None

    def key_set(self, layer: int, k: Tensor, v: Tensor) -> KeySet:
        """Keys for the queries of `layer` whose own construction KVs are `k, v`."""
        finished = []
        for m in self.sources[layer] if self.block_start > 0 else ():
            # Deeper groups see only the last w tokens before the block (deep_token_window).
            keep = (min(self.window, self.block_start) if self.window > 0 and m > layer
                    else self.block_start)
            finished += [(m - layer, pk, pv) for pk, pv in
                         zip(_tail(self.keys[m], keep), _tail(self.values[m], keep))]
        keys = KeySet(k=k, v=v, finished=finished)
        if self.prefix is not None:
            keys.prefix_k, keys.prefix_v = self.prefix[layer]
        return keys


class PieceHistory:
    """The growing history of one forward as per-block pieces per source layer."""

    def __init__(self, sources: list[list[int]], window: int) -> None:
        self.sources, self.window = sources, window
        self.keys: list[list[Tensor]] = [[] for _ in sources]
        self.values: list[list[Tensor]] = [[] for _ in sources]

    def view(self, block_start: int) -> PieceView:
        # Snapshots (tuples): a recomputed block must see exactly the pieces its forward saw.
        return PieceView(self.sources, self.window, block_start,
                         [tuple(p) for p in self.keys], [tuple(p) for p in self.values])

    def publish(self, block_start: int, fin_k: list[Tensor], fin_v: list[Tensor]) -> None:
        """Add a finished block's KVs (one per layer) to the history."""
        for pieces_k, pieces_v, k, v in zip(self.keys, self.values, fin_k, fin_v):
            pieces_k.append(k)
            pieces_v.append(v)


class BufferedHistory:
    """The history of one forward pass in per-reader buffers (module doc); one per forward call."""

    def __init__(self, sources: list[list[int]], window: int, layout: KeyLayout, like: Tensor,
                 kv_heads: int, length: int) -> None:
        self.sources, self.window, self.length = sources, window, length
        self._head = (like.shape[0], kv_heads)
        self.keys = [like.new_empty(*self._head, length * len(m), layout.width) for m in sources]
        self.values = [like.new_empty(*self._head, length * len(m), layout.width)
                       for m in sources]
        self.grad_keys: list[Tensor] | None = None
        self.grad_values: list[Tensor] | None = None
        self.published = 0
        """Tokens whose finished rows have been written (forward)."""
        self.released = math.inf
        """Tokens from here on are read by no later block any more (set in backward)."""
        self.anchor: Tensor | None = None

    def view(self, block_start: int) -> "BufferedView":
        return BufferedView(self, block_start, self.anchor)

    def publish(self, block_start: int, fin_k: list[Tensor], fin_v: list[Tensor]) -> None:
        """Make a finished block's KVs (one per layer) visible to every later block."""
        self.anchor = _Publish.apply(self, block_start, *fin_k, *fin_v)

    # ---- used by the autograd functions ---------------------------------------------------------
    def _rows(self, buffers: list[Tensor], layer: int, start: int, n: int) -> Tensor:
        """Rows of tokens start … start+n-1 of reader `layer` as `[B, H_kv, n, G_l, width]`."""
        group = len(self.sources[layer])
        return buffers[layer][:, :, start * group:(start + n) * group].unflatten(2, (n, group))

    def write_finished(self, start: int, fin_k: tuple[Tensor, ...],
                       fin_v: tuple[Tensor, ...]) -> None:
        if start != self.published:
            raise RuntimeError(f"finished KVs published out of order (block at {start}, "
                               f"expected {self.published})")
        n = fin_k[0].shape[2]
        for layer, sources in enumerate(self.sources):
            rows_k = self._rows(self.keys, layer, start, n)
            rows_v = self._rows(self.values, layer, start, n)
            for g, m in enumerate(sources):
                rows_k[:, :, :, g] = fin_k[m]
                rows_v[:, :, :, g] = fin_v[m]
        self.published = start + n

    def write_tail(self, layer: int, start: int, k_tail: Tensor, v_tail: Tensor) -> int:
        """Put a block's own keys behind its history; returns the key count (history + tail)."""
        if self.published > start and self.released > start:
            raise RuntimeError("a block's keys would overwrite finished KVs that a later block "
                               "still reads (backward ran out of order)")
        first = start * len(self.sources[layer])
        end = first + k_tail.shape[2]
        with torch.no_grad():
            self.keys[layer][:, :, first:end] = k_tail
            self.values[layer][:, :, first:end] = v_tail
        return end

    def mask(self, layer: int, start: int, n: int) -> Tensor | None:
        """Boolean mask `[n, keys]` for reader `layer`'s block at `start`: all history rows except,
        with deep_token_window, deeper slots of tokens older than the window; bottom-right causal
        over the tail. None when that is plain bottom-right causal."""
        group = len(self.sources[layer])
        if not self.window or group == 1 or start <= self.window:
            return None
        history = torch.ones(start, group, dtype=torch.bool, device=self.keys[0].device)
        history[:start - self.window, 1:] = False
        causal = torch.ones(n, n, dtype=torch.bool, device=history.device).tril()
        return torch.cat([history.flatten().expand(n, -1), causal], dim=1)

    def add_history_grad(self, layer: int, start: int, dk: Tensor, dv: Tensor) -> None:
        """Add a reader's gradient of its history rows `[B, H_kv, start·G_l, width]` to the
        per-source gradient buffers."""
        if self.grad_keys is None:
            self.grad_keys = [dk.new_zeros(*self._head, self.length, dk.shape[3])
                              for _ in self.sources]
            self.grad_values = [dv.new_zeros(*self._head, self.length, dv.shape[3])
                                for _ in self.sources]
        group = len(self.sources[layer])
        dk, dv = dk.unflatten(2, (start, group)), dv.unflatten(2, (start, group))
        for g, m in enumerate(self.sources[layer]):
            self.grad_keys[m][:, :, :start].add_(dk[:, :, :, g])
            self.grad_values[m][:, :, :start].add_(dv[:, :, :, g])

    def release(self, start: int, n: int) -> list[Tensor | None]:
        """Gradients of the finished KVs of the block at `start` (all later readers are done)."""
        self.released = start
        if self.grad_keys is None:
            return [None] * (2 * len(self.sources))
        rows = slice(start, start + n)
        return ([g[:, :, rows].clone() for g in self.grad_keys]
                + [g[:, :, rows].clone() for g in self.grad_values])


@dataclass
class BufferedView:
    """What one block reads of a `BufferedHistory`."""

    history: BufferedHistory
    block_start: int
    anchor: Tensor | None

    def key_set(self, layer: int, k: Tensor, v: Tensor) -> KeySet:
        if self.block_start == 0:
            return KeySet(k=k, v=v)
        return KeySet(k=k, v=v, stored=self)

    def attend(self, layer: int, q: Tensor, k_tail: Tensor, v_tail: Tensor, dropout_p: float,
               scale: float) -> Tensor:
        """SDPA of `q` over the history of reader `layer` followed by `k_tail`/`v_tail`."""
        return _ReadHistory.apply(q, k_tail, v_tail, self.anchor, self.history, layer,
                                  self.block_start, dropout_p, scale)


class _Publish(torch.autograd.Function):
    """Forward: write a block's finished KVs into the readers' buffers; return the anchor.
    Backward: return those KVs' gradients, accumulated by every later reader."""

    @staticmethod
    def forward(ctx: Any, history: BufferedHistory, start: int, *kv: Tensor) -> Tensor:
        layers = len(kv) // 2
        history.write_finished(start, kv[:layers], kv[layers:])
        ctx.history, ctx.start, ctx.n = history, start, kv[0].shape[2]
        return kv[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:
        return (None, None, *ctx.history.release(ctx.start, ctx.n))


class _ReadHistory(torch.autograd.Function):
    """SDPA over a reader's history rows (a view) and the block's tail; see the module doc."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k_tail: Tensor, v_tail: Tensor, anchor: Tensor,
                history: BufferedHistory, layer: int, start: int, dropout_p: float,
                scale: float) -> Tensor:
        rows = history.write_tail(layer, start, k_tail, v_tail)
        k, v = history.keys[layer][:, :, :rows], history.values[layer][:, :, :rows]
        mask = history.mask(layer, start, q.shape[2])
        ctx.args = history, layer, start, dropout_p, scale
        ctx.flash = _cpu_flash(q, dropout_p)
        if ctx.flash:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=_float_mask(mask, q, rows), scale=scale)
            ctx.save_for_backward(q, k_tail, v_tail, out, lse)
            return out
        ctx.rng = _rng_state(q.device) if dropout_p else None
        ctx.save_for_backward(q, k_tail, v_tail)
        return sdpa(q, k, v, dropout_p, scale, mask)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k_tail, v_tail, *saved = ctx.saved_tensors
        history, layer, start, dropout_p, scale = ctx.args
        # The tail is rewritten first: later blocks' finished rows may have replaced it.
        rows = history.write_tail(layer, start, k_tail, v_tail)
        k, v = history.keys[layer][:, :, :rows], history.values[layer][:, :, :rows]
        mask = history.mask(layer, start, q.shape[2])
        if ctx.flash:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad.contiguous(), q, k, v, *saved, 0.0, False,
                attn_mask=_float_mask(mask, q, rows), scale=scale)
        else:
            # No backward kernel to call directly: recompute with autograd on leaves that alias
            # the buffers (no copy), replaying the forward's dropout.
            with torch.enable_grad(), _restored_rng(ctx.rng, q.device):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                out = sdpa(*leaves, dropout_p, scale, mask)
                dq, dk, dv = torch.autograd.grad(out, leaves, grad)
        first = rows - k_tail.shape[2]
        history.add_history_grad(layer, start, dk[:, :, :first], dv[:, :, :first])
        return (dq, dk[:, :, first:], dv[:, :, first:], grad.new_zeros(()), None, None, None,
                None, None)


FLASH_ON_CPU = True
"""Call the CPU flash-attention kernels directly (forward saves its log-sum-exp, backward needs no
recompute). Off, or on other devices, the backward recomputes SDPA with autograd."""


def _cpu_flash(q: Tensor, dropout_p: float) -> bool:
    return FLASH_ON_CPU and q.device.type == "cpu" and dropout_p == 0.0


def _float_mask(mask: Tensor | None, q: Tensor, keys: int) -> Tensor:
    """The additive mask the flash kernel takes: `mask`, or bottom-right causal (see `sdpa`)."""
    n = q.shape[2]
    if mask is None:
        mask = torch.ones(n, keys, dtype=torch.bool, device=q.device).tril(keys - n)
    return torch.zeros(n, keys, dtype=q.dtype, device=q.device).masked_fill_(~mask, -math.inf)


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored_rng(state: tuple[Tensor, Tensor | None] | None,
                  device: torch.device) -> Iterator[None]:
    """Replay the forward's attention dropout in backward (same RNG state), leaving the caller's
    RNG streams untouched."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
