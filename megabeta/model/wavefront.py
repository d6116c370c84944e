"""The wavefront schedule of a beta12 training pass (spec §5): the cells of a wave together.

Cell (b, l), layer l on block b, needs cell (b, l-1) and the finished KVs of cells (b-1, m) for
m ∈ M(l) ⊆ [l, top(l)]. So with period p = min(k, L-1) + 1 the cells of wave t = b·p + l are
independent: (T/c - 1)·p + L waves instead of (T/c)·L cells, a wave holding up to ⌈L/p⌉ cells on
consecutive blocks at layers that step down by p (`WavePlan`).

What a wave computes, and how its cells are batched, is wave.py's (`run_wave`); this module
plans the waves and runs them in order.

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

from megabeta.model.history import BufferedHistory, PieceHistory, saved_unchecked
from megabeta.model.step_graphs import StepGraphs, Unit
from megabeta.model.wave import QKV, Entering, Wave, WaveOutput, enter, run_wave

if TYPE_CHECKING:  # only for annotations: beta12 imports this module
    from megabeta.model.beta12 import Beta12Transformer, PassWeights


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
    state, qkv = embeddings[0][None], tuple(t[None] for t in enter(model, weights,
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
