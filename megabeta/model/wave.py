"""One wave of (block, layer) cells (spec §5): the layer body of beta12, written once, over a
stack of n cells. Both schedules run it: the wavefront's waves hold up to ⌈L/p⌉ cells
(wavefront.py), a block of the block schedule is L waves of one cell (block_schedule.py, the
wavefront's plan at a period of L), and decoding runs that block step.

Where a cell ends. Layer m's finished K/V are projections of its output, which is layer m+1's
input: they come out of layer m+1's fused input projection (beta12.PassWeights). On the
wavefront they are first read one wave after cell (b, m), by cell (b+1, m-k), which runs in
the same wave as (b, m+1): so a cell is layer l's attention and MLP followed by layer l+1's
fused input projection (layer l's finished K/V, layer l+1's queries and construction K/V), and
the last layer's cell ends with `last_finished`. A block enters at layer 0 with its plain input
projection (`enter`): on the wavefront computed by the wave before the one it enters, so that
the carried cells' and its queries and construction K/V become the next wave's stacked inputs in
one copy; on the block schedule at the start of its own block step.

Batching. A wave's cells hold different layers' weights. Each kind of weight is stacked once
per pass in reverse layer order (`beta12.PassWeights`): a wave's cells, blocks ascending and
layers descending by the period, read one strided view of each stack, and each projection of
the wave is one batched matmul (`layers.stacked_linear`, which adds the stacks' gradients in
place instead of a zero-filled stack per wave). Norms, SwiGLU and the residual adds run once
on the stacked cells, the split into heads and RoPE once on the cells' tokens laid end to end.
The wave's attention is one `attend_wave` call of the model's backend on the cells' stacked
queries and construction K/V `[n, B, H, c, d_h]`, each cell reading its layer's key set at its
block's start and its layer's biases (strided views of the pass's stacks, beta12.PassBiases):
on `cpu_fused` one own-keys kernel and one finished-groups kernel for the whole wave
(attention/merged.py, `merged_cells`), on `triton` one launch each way
(attention/triton_backend.py); a wave of one cell attends as a block does (`attend`), and
`explicit` attends cell by cell.

Nothing here reads which blocks the cells are on (`Wave.first`): a compiled step serves every
wave of its kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from megabeta.model.attention.backend import split_cells
from megabeta.model.layers import stacked_linear

if TYPE_CHECKING:  # only for annotations: beta12 imports this module
    from megabeta.model.beta12 import Beta12Transformer, PassWeights

QKV = tuple[Tensor, Tensor, Tensor]
"""A wave's cells' queries, construction keys and values, stacked `[n, B, heads, c, d_h]`."""


@dataclass(frozen=True)
class Wave:
    """One wave's cells: blocks `first`, `first + 1`, … at `layers` (descending by p)."""

    first: int
    """The first (oldest) cell's block."""
    layers: list[int]
    top: int
    """L - 1."""
    entering: bool
    """Whether the newest cell is a block at layer 0 (its input projection runs first)."""
    period: int
    finished: bool = True
    """Whether the cells' finished K/V are wanted. False only for a wave of one cell whose
    block nobody reads (the last block of a block-schedule pass): its next input projections
    are the plain ones, and it ends without `last_finished`."""

    @property
    def cells(self) -> list[tuple[int, int]]:
        """(block, layer) per cell, oldest first."""
        return [(self.first + i, l) for i, l in enumerate(self.layers)]

    @property
    def exits(self) -> bool:
        """Whether the oldest cell is at the last layer (its block leaves after this wave)."""
        return self.layers[0] == self.top

    def stack(self) -> slice:
        """The cells' layers in a stack of all L layers in reverse order."""
        return slice(self.top - self.layers[0], self.top - self.layers[-1] + 1, self.period)

    def next_stack(self) -> slice:
        """The next input projections of the cells below the top (layers l+1 ≥ 1) in the stack
        of layers L-1 … 1."""
        below = self.layers[1:] if self.exits else self.layers
        return slice(self.top - 1 - below[0], self.top - below[-1], self.period)


@dataclass
class WaveOutput:
    """What one wave hands on (`run_wave`): the next wave's inputs, the finished K/V to
    publish and the leaving block's hidden states."""

    x: Tensor | None
    """The next wave's residual streams `[n, B, c, d]`: the continuing cells' and the entering
    block's embeddings (None: none)."""
    qkv: QKV | None
    """Their queries and construction K/V (layer l+1's for a continuing cell of layer l,
    layer 0's for the entering block)."""
    finished: list[tuple[Tensor, Tensor]]
    """Every cell's finished K, V (oldest cell first)."""
    hidden: Tensor | None
    """The leaving block's final hidden states `[B, c, d]`."""


@dataclass(frozen=True)
class Entering:
    """The block that enters the next wave at layer 0: its embeddings `[B, c, d]` and RoPE
    tables `[c, d_h]`."""

    x: Tensor
    cos: Tensor
    sin: Tensor


def run_wave(model: "Beta12Transformer", x: Tensor, qkv: QKV, views: list[Any], wave: Wave,
             weights: "PassWeights", cos: Tensor, sin: Tensor, entering: Entering | None, *,
             dropout: float, copy_next: bool = True) -> WaveOutput:
    """One wave's cells (module doc). `x`, `qkv`: the cells' residual streams and queries and
    construction KVs (stacked, oldest cell first); `views`: each cell's history view;
    `cos/sin [n, c, d_h]`: the cells' RoPE tables; `entering`: the block that enters the next
    wave, whose layer-0 projection is laid next to the continuing cells' here. `copy_next`:
    hand on the continuing cells' next inputs as copies (`_stack_cells`), for a next wave that
    is a recompute unit of its own; within a block step, whose block is the unit, they stay
    views (one copy fewer per cell)."""
    kernels, eps = model.elementwise_kernels, model.config.norm_eps
    attention = model.attention_backend
    n, batch, c, d = x.shape
    q, k, v = qkv
    keys = [view.key_set(l, k_i, v_i) for view, l, k_i, v_i in zip(views, wave.layers,
                                                                   split_cells(k), split_cells(v))]
    sel = wave.stack()
    o = attention.attend_wave(q, k, v, keys, weights.pass_biases.wave(sel), layers=wave.layers,
                              dropout_p=dropout).reshape(n, batch * c, -1)
    x, mlp = model.branches(x, o, weights.branches(sel))
    if wave.exits and not wave.finished:
        # The last layer of a block whose finished K/V nobody reads: its stream, no norm.
        return WaveOutput(None, None, [], (x + mlp).squeeze(0))
    x, normalized = kernels.add_rms_normalize(x, mlp, eps)
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
        finished.append(tuple(weights.last_finished(leaving, cos[0], sin[0])))
    continuing = None
    if len(x):
        below = int(wave.exits)
        continuing, fin = _next_inputs(normalized, weights, wave, cos[below:], sin[below:])
        finished += fin
    block = None
    if entering is not None:
        block = enter(model, weights, entering)
        x = torch.cat([x, entering.x[None]]) if len(x) else entering.x[None]
    return WaveOutput(x if len(x) else None, _stack_cells(continuing, block, c, copy=copy_next),
                      finished, hidden)


def enter(model: "Beta12Transformer", weights: "PassWeights", block: Entering) -> QKV:
    """A block's layer-0 queries and construction K/V `[B, heads, c, d_h]` each."""
    normalized = model.elementwise_kernels.rms_normalize(block.x, model.config.norm_eps)
    return tuple(weights.input(0, False)(normalized, block.cos, block.sin))


def _stack_cells(continuing: QKV | None, entering: QKV | None, cell_tokens: int, *,
                 copy: bool) -> QKV | None:
    """The next wave's queries and construction K/V stacked per cell `[n, B, heads, c, d_h]`:
    the continuing cells' (`[B, heads, n'·c, d_h]`, cells end to end: the projection's
    outputs), then the entering block's (`[B, heads, c, d_h]`). The continuing cells' are
    views of tensors that also hold their finished K/V, which are copied into the history:
    what the next wave keeps (and its checkpoint holds until backward) is a copy, one per
    tensor (the concatenation where a block enters), so that their storage goes once they are
    published; without `copy` (within a block step) the views themselves."""
    if continuing is None:
        return None if entering is None else tuple(t[None] for t in entering)
    if entering is None:
        # Copied in the projection's layout and stacked as a view: the attention kernels take
        # the strides, and the gradient comes back in that layout (stacked contiguously, it
        # would be copied back in backward).
        return tuple(_cells(t.clone(memory_format=torch.contiguous_format) if copy else t,
                            cell_tokens) for t in continuing)
    return tuple(torch.cat([_cells(t, cell_tokens), e[None]])
                 for t, e in zip(continuing, entering))


def _cells(t: Tensor, cell_tokens: int) -> Tensor:
    """`[B, heads, n·c, d_h]`, n cells end to end, as `[n, B, heads, c, d_h]` (a view)."""
    return t.unflatten(2, (-1, cell_tokens)).movedim(2, 0)


def _next_inputs(normalized: Tensor, weights: "PassWeights", wave: Wave, cos: Tensor,
                 sin: Tensor) -> tuple[QKV, list[tuple[Tensor, Tensor]]]:
    """The next layer's fused input projection of the wave's cells below the top,
    `normalized [n, B, c, d]`: their next queries and construction K/V (`[B, heads, n·c, d_h]`,
    the cells' tokens end to end), and per cell its own finished K/V (none where the wave's
    are not wanted: the next layer's plain projection)."""
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


