"""`triton`: a block's whole key set in one fused Triton kernel per (block, layer), or a wave's
cells in one.

The kernel (`megabeta/kernels/triton_attention.py`) reads what spec §3 gives the queries of block
b at layer l straight from the history buffers: the block's own keys (causal, b_σ on the
diagonal) and, for every source m ∈ M(l), rows [lo, start) of layer m's finished keys (the
deep-token window's rows for a deeper source), with the depth bias λ_h·(m - l) subtracted from
that group's scores; one online softmax over all of it. Its backward adds the groups' key and
value gradients into the history's gradient buffers in place.

The buffers are the whole sequence's (`[L, B, H_kv, T, d_h]`) and the block's start is read from
a device tensor, so every block launches the same shapes: nothing here depends on the block
index but the tensors' contents (what `torch.compile` and CUDA graphs need).

On the wavefront schedule (spec §5) the cells of a wave, on consecutive blocks at layers that
step down by k+1, go to the same kernels as one call of stacked cells (`attend_wave`): one
launch forward and one backward per wave, whatever the number of cells.

Document masks (spec §7, `KeySet.documents`): the kernels read each query row's lower bound
from the bounds tensor (an ordinary input: one compiled graph for every block here too) and
skip the key tiles wholly below a query tile's smallest bound; a wave's cells read one strided
view of the pass's bounds. Without documents the kernels are compiled without the mask.

Decoding hands attention the history as pieces; those calls go to the `explicit` backend,
which computes the same function (a decoding step's score matrix is one row per query).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megabeta.kernels import triton_attention
from megabeta.model.attention.backend import (
    AttentionBias,
    Capabilities,
    CellByCell,
    KeyLayout,
    KeySet,
    StoredHistory,
    WaveBias,
    after_backward,
    consecutive,
)
from megabeta.model.attention.explicit import ExplicitAttention


class TritonAttention(CellByCell):
    """The `triton` backend; `pieces` (explicit) serves the calls that come with the history as
    pieces."""

    name = "triton"
    reads_buffers = True
    # CUDA (or a CPU under Triton's interpreter: select.py asks elementwise.require_triton).
    capabilities = Capabilities(devices=frozenset({"cuda", "cpu"}), dropout=False,
                                static_step=True, batched_waves=True, documents=True,
                                static_waves=True)

    def __init__(self, head_dim: int) -> None:
        self.layout = KeyLayout(head_dim)
        self.pieces = ExplicitAttention(head_dim)

    def attend(self, q: Tensor, keys: KeySet, bias: AttentionBias, *, layer: int,
               dropout_p: float) -> Tensor:
        _no_dropout(dropout_p)
        stored = keys.stored
        if stored is None and (keys.finished or keys.history_pieces()[0]):
            return self.pieces.attend(q, keys, bias, layer=layer, dropout_p=dropout_p)
        scale = 1.0 / math.sqrt(q.shape[-1])
        # The bias gradients' rows go to the pass's buffers wherever it has them, the first
        # block's too (its diagonal at positions 0…n-1): every training launch is then one
        # kind of kernel (ROWS_AT_START), one compile.
        rows = {}
        if bias.rows is not None and torch.is_grad_enabled():
            shift_rows, diag_rows = bias.rows.layer_buffers(layer, q.shape[0], q.shape[1], q)
            rows = dict(shift_rows=shift_rows, diag_rows=diag_rows)
        lower = None if keys.documents is None else keys.documents.lower
        if stored is None:
            # A block with no history (the first, or a sequence of at most c tokens): own keys.
            # Empty stand-ins for the history, its gradient buffers float32 like a real one's
            # (the same compiled kernel).
            if keys.documents is not None and keys.documents.start != 0:
                raise ValueError(f"triton attention: a block without history at position "
                                 f"{keys.documents.start} (the kernels put it at 0)")
            empty, grads = q.new_empty(0), q.new_empty(0, dtype=torch.float32)
            return triton_attention.block_attention(
                q, keys.k.to(q.dtype), keys.v.to(q.dtype), empty, empty, grads, grads,
                q.new_zeros((), dtype=torch.int64), q.new_empty(0, q.shape[1]), bias.self_bias,
                sources=[], layer=layer, window=0, scale=scale, lower=lower, **rows)
        # In the buffers' dtype: the kernels take one, and autocast does not reach them.
        dtype = stored.dtype
        hist_k, hist_v = stored.buffers()
        grad_k, grad_v = _gradient_buffers(stored)
        q = after_backward(q.to(dtype), stored.done_reading)
        return triton_attention.block_attention(
            q, keys.k.to(dtype), keys.v.to(dtype), hist_k, hist_v, grad_k, grad_v,
            stored.start_index(), bias.group_shift, bias.self_bias, sources=stored.sources(layer),
            layer=layer, window=stored.window, scale=scale, anchor=stored.anchor, lower=lower,
            **rows)

    def attend_wave(self, q: Tensor, k: Tensor, v: Tensor, keys: list[KeySet], bias: WaveBias,
                    *, layers: list[int], dropout_p: float) -> Tensor:
        """The wave's cells in one kernel call (module doc). The newest cell reads history in
        any wave of several cells (its block is not the first); a wave of one cell at block 0
        reads none and goes to `attend`."""
        _no_dropout(dropout_p)
        stored = [key_set.stored for key_set in keys]
        last = stored[-1]
        if last is None:
            return super().attend_wave(q, k, v, keys, bias, layers=layers, dropout_p=dropout_p)
        hist_k, hist_v = last.buffers()
        cells = triton_attention.Cells.of(last.sources(layers[-1]), layers, hist_k.shape[0] - 1)
        if last.block_start is not None:  # a static step's views know no Python start
            _check_wave(stored, layers, cells, q.shape[3])
        dtype = last.dtype
        # Each cell's reader reports when its backward is done (history.py's order check; a
        # static step's report nothing).
        readers = [s.done_reading for s in stored if s is not None and s.done_reading]
        q = after_backward(q.to(dtype),
                           (lambda: [done() for done in readers]) if readers else None)
        grad_k, grad_v = _gradient_buffers(last)
        row_buffers = bias.row_buffers(q.shape[1], q.shape[2], q)
        rows = {} if row_buffers is None else dict(zip(("shift_rows", "diag_rows"), row_buffers))
        out = triton_attention.wave_attention(
            q, k.to(dtype), v.to(dtype), hist_k, hist_v, grad_k, grad_v, last.start_index(),
            bias.group_shift, bias.self_bias, sources=last.sources(layers[-1]), layers=layers,
            top=cells.top, window=last.window, scale=1.0 / math.sqrt(q.shape[-1]),
            anchor=last.anchor, lower=_wave_bounds(keys), **rows)
        return out.transpose(2, 3)


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise ValueError("triton attention has no dropout (select the explicit backend)")


def _gradient_buffers(stored: StoredHistory) -> tuple[Tensor, Tensor]:
    """The history's gradient buffers when training (empty stand-ins otherwise)."""
    if torch.is_grad_enabled():
        return stored.gradient_buffers()
    empty = stored.buffers()[0].new_empty(0)
    return empty, empty


def _wave_bounds(keys: list[KeySet]) -> Tensor | None:
    """The cells' document bounds `[cells, B, n]`: one strided view of the pass's bounds (the
    cells are consecutive blocks, `backend.consecutive`). None without documents."""
    if keys[0].documents is None:
        return None
    return consecutive([key_set.documents.lower for key_set in keys])


def _check_wave(stored: list[StoredHistory | None], layers: list[int],
                cells: triton_attention.Cells, n: int) -> None:
    """The kernels derive each cell's start and sources from the newest cell's: check that
    they are what the history gives (consecutive blocks of n tokens; M(l) of spec §3)."""
    last = stored[-1].block_start
    for i, (s, layer) in enumerate(zip(stored, layers)):
        start = last - (len(stored) - 1 - i) * n
        got = (0, []) if s is None else (s.block_start, s.sources(layer))
        if got[0] != start or (s is not None and got[1] != cells.sources(i)):
            raise ValueError(f"triton wave attention: cell {i} (layer {layer}) starts at "
                             f"{got[0]} reading sources {got[1]}; the kernels would read "
                             f"{start} and {cells.sources(i)}")
