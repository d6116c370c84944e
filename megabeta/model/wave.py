"""One wave of (block, layer) cells (spec §5): beta12's layer body, written once, over a stack of
n cells. Every pass runs it: the plan's waves (model/plan.py: up to ⌈L/p⌉ cells on the
wavefront, one cell a wave on the block schedule) and decoding (model/cache.py: a wave of one
cell per layer on the new tokens of the current block).

Where a cell ends. Layer m's finished K/V are projections of its output, which is layer m+1's
input: they come out of layer m+1's fused input projection (pass_weights.PassWeights). So a
cell is layer l's attention and MLP followed by layer l+1's fused input projection (layer l's
finished K/V, layer l+1's queries and construction K/V); the last layer's cell ends with
`last_finished`. A block enters at layer 0 with its plain input projection, at the start of the
wave that holds its first cell.

Batching. A wave's cells hold different layers' weights. Each kind of weight is stacked once
per pass in reverse layer order: a wave's cells, blocks ascending and layers descending by the
period, read one strided view of each stack, and each projection of the wave is one batched
matmul (`layers.stacked_linear`). Norms, SwiGLU and the residual adds run once on the stacked
cells, the split into heads and RoPE once on the cells' tokens laid end to end. The attention is
one call of the model's backend on the cells' stacked queries and construction K/V
`[n, B, H, c, d_h]`, each cell reading its layer's key set at its block's start (`Reads`).

Nothing here reads which blocks the cells are on but the tensors' contents: a compiled unit
serves every unit of its kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from megabeta.model.attention.backend import AttentionBackend, Reads
from megabeta.model.layers import (
    BranchWeights,
    ElementwiseKernels,
    matmul_dtype,
    residual_branches,
    stacked_linear,
)
from megabeta.model.pass_weights import PassWeights
from megabeta.model.plan import Wave

QKV = tuple[Tensor, Tensor, Tensor]
"""A wave's cells' queries, construction keys and values, stacked `[n, B, heads, c, d_h]`."""


@dataclass(frozen=True)
class Body:
    """What the layer body needs of its model, fixed when the model is placed on its device."""

    attention: AttentionBackend
    kernels: ElementwiseKernels
    eps: float
    branches: Callable[..., tuple[Tensor, Tensor]] = residual_branches
    """`layers.residual_branches` (compiled where the executor compiles it)."""


@dataclass
class Carried:
    """The continuing cells' state between two waves: residual streams `x [n, B, c, d]` and the
    next layer's queries and construction K/V (`QKV`)."""

    x: Tensor
    q: Tensor
    k: Tensor
    v: Tensor

    def tensors(self) -> list[Tensor]:
        return [self.x, self.q, self.k, self.v]


@dataclass(frozen=True)
class Entering:
    """A block entering at layer 0: its embeddings `[B, c, d]` and RoPE tables `[c, d_h]`."""

    x: Tensor
    cos: Tensor
    sin: Tensor


@dataclass
class WaveOutput:
    """What one wave hands on: the next wave's carried state, the finished K/V of its cells
    (oldest first; none in a pass of one block) and the leaving block's hidden states."""

    carried: Carried | None
    finished: list[tuple[Tensor, Tensor]]
    hidden: Tensor | None
    """The leaving block's final hidden states `[B, c, d]`."""


@dataclass
class OwnKeys:
    """Decoding: the current block's construction K/V buffers `[L, B, H_kv, c, d_h]` and how many
    of its tokens came before the new ones (the new queries' own keys are rows [0, offset + n))."""

    keys: Tensor
    values: Tensor
    offset: int

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write one cell's new construction K/V `[1, B, H_kv, n, d_h]`; its own keys so far."""
        end = self.offset + k.shape[3]
        self.keys[layer, :, :, self.offset:end] = k[0]
        self.values[layer, :, :, self.offset:end] = v[0]
        return self.keys[layer, None, :, :, :end], self.values[layer, None, :, :, :end]


def enter(body: Body, weights: PassWeights, x: Tensor, cos: Tensor, sin: Tensor) -> QKV:
    """A block's layer-0 queries and construction K/V `[B, heads, n, d_h]` each, from its
    embeddings `x [B, n, d]` (RoPE tables `[n, d_h]`)."""
    normalized = body.kernels.rms_normalize(x, body.eps, dtype=matmul_dtype(x))
    return tuple(weights.input(0, False)(normalized, cos, sin))


def run_wave(body: Body, weights: PassWeights, wave: Wave, carried: Carried | None,
             entering: Tensor | None, reads: Reads, cos: Tensor, sin: Tensor, *,
             dropout: float, copy_next: bool = False, joining: Entering | None = None,
             own: OwnKeys | None = None) -> WaveOutput:
    """One wave's cells (module doc). Either `carried`, the state the wave before handed on
    (the entering block's already joined), or `entering`, the embeddings `[B, c, d]` of the
    one block that enters at layer 0 in this wave; `cos/sin [n, c, d_h]`: the cells' RoPE
    tables, oldest first; `copy_next`: hand on the next state as copies (at a unit's end, whose successor keeps it until backward) rather than views of
    the projections' outputs, which also hold the finished K/V; `joining`: the block that
    enters in the next wave, projected at this one's end and concatenated to the state handed
    on (model/plan.py; the concatenation is the copy); `own`: decoding's construction
    buffers."""
    if (carried is None) == (entering is None):
        raise ValueError("run_wave: give the state handed on or one entering block, not both")
    if entering is not None:
        x = entering[None]
        q, k, v = (t[None] for t in enter(body, weights, entering, cos[-1], sin[-1]))
    else:
        x, q, k, v = carried.tensors()
    n, batch, c = x.shape[:3]
    if own is not None:
        k, v = own.extend(wave.layers[0], k, v)
    sel = wave.stack()
    biases = weights.biases(sel, rows_wanted=body.attention.capabilities.bias_rows)
    o = body.attention.attend(q, k, v, reads, biases, dropout_p=dropout)
    x, mlp = body.branches(x, o.reshape(n, batch * c, -1), weights.branches(sel),
                           kernels=body.kernels, eps=body.eps, dropout=dropout)
    if wave.exits and not wave.finished:
        # The last layer of a pass of one block: its stream, no norm (the head norms it).
        return WaveOutput(None, [], (x + mlp).squeeze(0))
    x, normalized = body.kernels.add_rms_normalize(x, mlp, body.eps, dtype=matmul_dtype(x))
    finished: list[tuple[Tensor, Tensor]] = []
    hidden = None
    if wave.exits:
        if n == 1:
            # Squeezed (a view's gradient); the empty rest is never read, so gets none.
            hidden, leaving, x, normalized = (x.squeeze(0), normalized.squeeze(0), x[1:],
                                              normalized[1:])
        else:
            # Split, not indexed: one concatenation in backward instead of a zero-filled
            # gradient per part and their sum.
            (hidden, x), (leaving, normalized) = (t.split([1, n - 1]) for t in (x, normalized))
            hidden, leaving = hidden.squeeze(0), leaving.squeeze(0)
        fk, fv = weights.last_finished(leaving, cos[0], sin[0])
        finished.append((fk, fv))
    nxt = None
    if len(x):
        below = int(wave.exits)
        parts, fin = _next_inputs(normalized, weights, wave, cos[below:], sin[below:])
        finished += fin
        if joining is not None:
            entered = enter(body, weights, joining.x, joining.cos, joining.sin)
            x = torch.cat([x, joining.x[None]])
            q, k, v = (torch.cat([_cells(t, c), e[None]]) for t, e in zip(parts, entered))
        else:
            # x needs no copy: a view of the stream, whose leaving row is kept anyway (hidden).
            # Copied in the projection's layout: the attention kernels take the strides, and
            # the gradient comes back in that layout.
            q, k, v = (_cells(t.clone(memory_format=torch.contiguous_format) if copy_next else t,
                              c) for t in parts)
        nxt = Carried(x, q, k, v)
    return WaveOutput(nxt, finished, hidden)


def _cells(t: Tensor, cell_tokens: int) -> Tensor:
    """`[B, heads, n·c, d_h]`, n cells end to end, as `[n, B, heads, c, d_h]` (a view)."""
    return t.unflatten(2, (-1, cell_tokens)).movedim(2, 0)


def _next_inputs(normalized: Tensor, weights: PassWeights, wave: Wave, cos: Tensor,
                 sin: Tensor) -> tuple[QKV, list[tuple[Tensor, Tensor]]]:
    """The next layer's fused input projection of the wave's cells below the top,
    `normalized [n, B, c, d]`: their next queries and construction K/V (`[B, heads, n·c, d_h]`,
    the cells' tokens end to end), and per cell its own finished K/V (none in a pass of one
    block: the next layer's plain projection)."""
    n, batch, c, d = normalized.shape
    if not wave.finished:
        # One cell: squeezed, not indexed (an index's backward fills a zero tensor).
        parts = weights.input(wave.layers[0] + 1, False)(normalized.squeeze(0), cos[0], sin[0])
        return tuple(parts), []
    sel = wave.next_stack()
    project = weights.next
    y = stacked_linear(normalized.flatten(1, 2), project.weight, sel, project.bias)
    # The cells' tokens end to end, `[B, n·c, W]`: one split into heads and RoPE for all.
    y = y.view(n, batch, c, -1).transpose(0, 1).flatten(1, 2)
    head_norm = None
    if project.head_norm is not None:
        norms = project.head_norm[sel]  # [n, heads, d_h]
        head_norm = norms.transpose(0, 1)[:, :, None].expand(-1, -1, c, -1).flatten(1, 2)
    fk, q, k, v, fv = project.split(y, cos.flatten(0, 1), sin.flatten(0, 1), head_norm)
    # One cell: its finished K/V as they are (unbound, their gradients would be stacked).
    fk, fv = ((p,) if n == 1 else p.unflatten(2, (n, c)).unbind(2) for p in (fk, fv))
    return (q, k, v), list(zip(fk, fv))


__all__ = ["Body", "Carried", "Entering", "OwnKeys", "QKV", "WaveOutput", "enter", "run_wave"]
