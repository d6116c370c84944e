"""The wavefront schedule of a beta12 training pass (spec §5): the cells of a wave together.

Cell (b, l), layer l on block b, needs cell (b, l-1) and the finished KVs of cells (b-1, m) for
m ∈ M(l) ⊆ [l, top(l)]. So with period p = min(k, L-1) + 1 the cells of wave t = b·p + l are
independent: (T/c - 1)·p + L waves instead of (T/c)·L cells, a wave holding up to ⌈L/p⌉ cells on
consecutive blocks at layers that step down by p (`WavePlan`).

Where a cell ends. In the block schedule layer m's finished K/V come out of layer m+1's input
matmul (beta12.PassWeights). Here they are first read one wave after cell (b, m), by cell
(b+1, m-k), which runs in the same wave as (b, m+1): so a cell is layer l's attention and MLP
followed by layer l+1's fused input projection (layer l's finished K/V, layer l+1's queries and
construction K/V): the same matmuls of the same numbers as the block schedule, done one wave
earlier. A block enters at layer 0 with its plain input projection, computed by the wave
before the one it enters (block 0's before the first), so that the carried cells' and its
queries and construction K/V become the next wave's stacked inputs in one copy; its last
layer's cell ends with `last_finished`.

Batching. A wave's cells hold different layers' weights. Each kind of weight is stacked once
per pass in reverse layer order (`beta12.PassWeights`, the block schedule's too): a wave's
cells, blocks ascending and layers descending by p, read one strided view of each stack, and
each projection of the wave is one batched matmul (`layers.stacked_linear`, which adds the
stacks' gradients in place instead of a zero-filled stack gradient per wave). Norms, SwiGLU and
the residual adds run once on the stacked cells, the split into heads and RoPE once on the
cells' tokens laid end to end. The wave's attention is one `attend_wave` call of the model's
backend on the cells' stacked queries and construction K/V `[n, B, H, c, d_h]`, each cell
reading its layer's key set at its block's start and its layer's biases (strided views of the
pass's stacks, beta12.PassBiases): on `cpu_fused` one own-keys kernel and one finished-groups
kernel for the whole wave (attention/merged.py, `merged_cells`; on `cpu_flash` the same own-keys
kernel, and ATen's per stack of each cell for the groups), on `triton` one launch each way
(attention/triton_backend.py); `explicit` attends cell by cell.

Finished KVs are published per wave, one cell per layer (history.py), except the last block's,
which nobody reads. With `activation_checkpoint = wave` one wave is the recompute unit: backward
keeps each wave's inputs (the cells' residual streams and next queries and construction KVs).
With `execution.compile` (beta12 `compile_steps`) each wave runs `run_wave` compiled, reading
static history views: one graph per kind of wave (`WavePlan.kinds`); with `execution.cuda_graphs`
each kind of wave is captured in two CUDA graphs (step_graphs.py).

A ragged last block is padded to c tokens with zero embeddings: causality keeps the padding out
of every real token (it follows them in the block, and the last block publishes nothing) and its
outputs are dropped, so its gradients are zero.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import Tensor

from megabeta.model.attention.backend import split_cells
from megabeta.model.history import BufferedHistory, PieceHistory, saved_unchecked
from megabeta.model.layers import stacked_linear
from megabeta.model.step_graphs import StepGraphs, Unit

if TYPE_CHECKING:  # only for annotations: beta12 imports this module
    from megabeta.model.beta12 import Beta12Transformer, PassWeights

QKV = tuple[Tensor, Tensor, Tensor]
"""A wave's cells' queries, construction keys and values, stacked `[n, B, heads, c, d_h]`."""


@dataclass(frozen=True)
class WavePlan:
    """Which cells run in which wave, for `blocks` blocks of `layers` layers and period p."""

    blocks: int
    layers: int
    period: int
    """p = min(k, L-1) + 1: cell (b, l) runs in wave b·p + l."""

    @property
    def waves(self) -> int:
        return (self.blocks - 1) * self.period + self.layers

    def kinds(self) -> int:
        """How many kinds of wave the plan has: a compiled `run_wave` has one graph per kind,
        the wave's layers, whether a block leaves after it and whether one enters the next."""
        waves = [self.wave(t) for t in range(self.waves)]
        entering_next = [w.entering for w in waves[1:]] + [False]
        return len({(tuple(w.layers), w.exits, e) for w, e in zip(waves, entering_next)})

    def wave(self, t: int) -> "Wave":
        p, top = self.period, self.layers - 1
        low = max(t % p, t - (self.blocks - 1) * p)
        high = min(top, t) - (min(top, t) - t) % p
        first = (t - high) // p
        layers = list(range(high, low - 1, -p))
        return Wave(first, layers, top, entering=layers[-1] == 0, period=p)


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
             dropout: float) -> WaveOutput:
    """One wave's cells (module doc). `x`, `qkv`: the cells' residual streams and queries and
    construction KVs (stacked, oldest cell first); `views`: each cell's history view;
    `cos/sin [n, c, d_h]`: the cells' RoPE tables; `entering`: the block that enters the next
    wave, whose layer-0 projection is laid next to the continuing cells' here. Nothing here
    reads which blocks the cells are on (`wave.first`): a compiled step serves every wave of
    its kind."""
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
        fk, fv = weights.last_finished(leaving, cos[0], sin[0])
        finished.append((fk, fv))
    continuing = None
    if len(x):
        below = int(wave.exits)
        continuing, fin = _next_inputs(normalized, weights, wave.next_stack(), cos[below:],
                                       sin[below:])
        finished += fin
    block = None
    if entering is not None:
        block = _enter(model, weights, entering)
        x = torch.cat([x, entering.x[None]]) if len(x) else entering.x[None]
    return WaveOutput(x if len(x) else None, _stack_cells(continuing, block, c), finished,
                      hidden)


def _enter(model: "Beta12Transformer", weights: "PassWeights", block: Entering) -> QKV:
    """A block's layer-0 queries and construction K/V `[B, heads, c, d_h]` each."""
    normalized = model.elementwise_kernels.rms_normalize(block.x, model.config.norm_eps)
    return tuple(weights.input(0, False)(normalized, block.cos, block.sin))


def _stack_cells(continuing: QKV | None, entering: QKV | None, block_size: int) -> QKV | None:
    """The next wave's queries and construction K/V stacked per cell `[n, B, heads, c, d_h]`:
    the continuing cells' (`[B, heads, n'·c, d_h]`, cells end to end: the projection's
    outputs), then the entering block's (`[B, heads, c, d_h]`). The continuing cells' are
    views of tensors that also hold their finished K/V, which are copied into the history:
    what the next wave keeps (and its checkpoint holds until backward) is a copy, one per
    tensor (the concatenation where a block enters), so that their storage goes once they are
    published."""
    if continuing is None:
        return None if entering is None else tuple(t[None] for t in entering)
    if entering is None:
        # Copied in the projection's layout and stacked as a view: the attention kernels take
        # the strides, and the gradient comes back in that layout (stacked contiguously, it
        # would be copied back in backward).
        return tuple(_cells(t.clone(memory_format=torch.contiguous_format), block_size)
                     for t in continuing)
    return tuple(torch.cat([_cells(t, block_size), e[None]])
                 for t, e in zip(continuing, entering))


def _cells(t: Tensor, block_size: int) -> Tensor:
    """`[B, heads, n·c, d_h]`, n cells end to end, as `[n, B, heads, c, d_h]` (a view)."""
    return t.unflatten(2, (-1, block_size)).movedim(2, 0)


def _next_inputs(normalized: Tensor, weights: "PassWeights", sel: slice, cos: Tensor,
                 sin: Tensor) -> tuple[QKV, list[tuple[Tensor, Tensor]]]:
    """The next layer's fused input projection of the cells `normalized [n, B, c, d]`: their
    next queries and construction K/V (`[B, heads, n·c, d_h]`, the cells' tokens end to end),
    and per cell its own finished K/V."""
    n, batch, c, d = normalized.shape
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


def wave_plan(model: "Beta12Transformer", length: int) -> WavePlan:
    """The waves of a pass of `length` tokens (padded to whole blocks)."""
    layers = len(model.layers)
    return WavePlan(-(-length // model.config.block_size), layers,
                    min(model.config.depth_window, layers - 1) + 1)


def run_wavefront(model: "Beta12Transformer", x: Tensor, cos: Tensor, sin: Tensor,
                  weights: "PassWeights", history: BufferedHistory | PieceHistory, *,
                  dropout: float, static: bool) -> Tensor:
    """The final hidden states `[B, T, d]` of the embeddings `x [B, T, d]` (T > c), wave by
    wave; `cos/sin [T', d_h]` cover the padded length T' = ⌈T/c⌉·c. `static`: every wave
    through the model's compiled step (`compiled_step`, `run_wave` compiled) and/or its CUDA
    graphs (`step_graphs`, its pass begun), reading the history's static views (`step_view`,
    allocated before) and `weights` built for tracing; otherwise `run_wave`, eagerly."""
    c, length = model.config.block_size, x.shape[1]
    step = model.compiled_step if static else None
    graphs = model.step_graphs if static else None
    plan = wave_plan(model, length)
    blocks = plan.blocks
    if blocks * c > length:
        x = F.pad(x, (0, 0, 0, blocks * c - length))
    cos, sin = cos.unflatten(0, (blocks, c)), sin.unflatten(0, (blocks, c))
    embeddings = x.split(c, dim=1)

    def entering(t: int) -> Entering | None:
        """The block entering at wave t, if any."""
        if t >= plan.waves or not plan.wave(t).entering:
            return None
        b = t // plan.period
        return Entering(embeddings[b], cos[b], sin[b])

    hidden: list[Tensor] = []
    # Block 0 enters before the first wave; each later block is laid out by the wave before
    # the one it enters.
    state, qkv = embeddings[0][None], tuple(t[None] for t in _enter(model, weights,
                                                                      entering(0)))
    with contextlib.ExitStack() as scope:
        if static:
            scope.enter_context(saved_unchecked())
        if step is not None:
            # One graph per kind of wave (and per grad mode): more than dynamo's default limit
            # of recompiles of one function where the plan has many kinds.
            limit = max(torch._dynamo.config.recompile_limit, 2 * plan.kinds())
            scope.enter_context(torch._dynamo.config.patch(recompile_limit=limit))
        for t in range(plan.waves):
            wave = plan.wave(t)
            views = [history.step_view(b * c, c) if static else history.view(b * c)
                     for b, _ in wave.cells]
            cells = slice(wave.first, wave.first + len(wave.layers))
            if graphs is not None:
                out = _replay_wave(graphs, step or run_wave, model, state, qkv, views, wave,
                                   cos[cells], sin[cells], entering(t + 1), dropout=dropout)
            else:
                out = model._run(step or run_wave, model, state, qkv, views, wave, weights,
                                 cos[cells], sin[cells], entering(t + 1), dropout=dropout)
            published = [(b * c, l) for b, l in wave.cells if b < blocks - 1]
            if published:
                history.publish(published, [k for k, _ in out.finished[:len(published)]],
                                [v for _, v in out.finished[:len(published)]])
            if out.hidden is not None:
                hidden.append(out.hidden)
            state, qkv = out.x, out.qkv
    return torch.cat(hidden, dim=1)[:, :length]


def _replay_wave(graphs: StepGraphs, step: Callable[..., WaveOutput], model: "Beta12Transformer",
                 x: Tensor, qkv: QKV, views: list[Any], wave: Wave, cos: Tensor, sin: Tensor,
                 entering: Entering | None, *, dropout: float) -> WaveOutput:
    """One wave through its kind's CUDA graphs (`run_wave`'s arguments; `step` the function
    captured). Its kind: its layers (which fix whether a block leaves) and whether one
    enters, as a compiled step's (`WavePlan.kinds`)."""

    def unit(inputs: list[Tensor], constants: list[Tensor], views: list[Any],
             weights: "PassWeights") -> tuple:
        x, q, k, v, *block = inputs
        cos, sin, *rope = constants
        out = step(model, x, (q, k, v), views, wave, weights, cos, sin,
                   Entering(block[0], *rope) if block else None, dropout=dropout)
        return out.x, out.qkv, out.finished, out.hidden

    block = [] if entering is None else [entering]
    out = graphs.run(Unit(kind=("wave", tuple(wave.layers), bool(block), dropout), fn=unit,
                          inputs=[x, *qkv, *(e.x for e in block)],
                          constants=[cos, sin, *(t for e in block for t in (e.cos, e.sin))],
                          views=views))
    return WaveOutput(*out)
