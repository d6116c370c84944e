"""The block schedule of a beta12 pass (spec §5): block by block, each through all layers.

A block is the wavefront's plan at a period of L: L waves of one cell, layer 0 … L-1 on the
block's tokens (`run_block`, over wave.py's `run_wave`), so both schedules run the same layer
body on the same numbers. Each block publishes its finished K/V, which every later block reads.
With `activation_checkpoint = block` a block is the recompute unit. A static pass
(`execution.compile` or `cuda_graphs`) runs every full block through the compiled step or its
CUDA graphs (step_graphs.py), reading the history's static views; a ragged last block runs
eagerly (it would be a second graph). Decoding runs the same block step on a partly filled
block (beta12 `extend`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megabeta.model.history import (
    BufferedHistory,
    HistoryView,
    PieceHistory,
    PieceView,
    block_cells,
    saved_unchecked,
)
from megabeta.model.step_graphs import Unit
from megabeta.model.wave import Entering, Wave, enter, run_wave

if TYPE_CHECKING:  # only for annotations: beta12 imports this module
    from megabeta.model.beta12 import Beta12Transformer, PassWeights


@dataclass
class BlockOutput:
    """What one block step hands on."""

    hidden: Tensor
    """Final hidden states `[B, n, d]`."""
    finished_k: list[Tensor] = field(default_factory=list)
    """Per layer, the block's finished keys (when asked for)."""
    finished_v: list[Tensor] = field(default_factory=list)
    construction_k: list[Tensor] = field(default_factory=list)
    """Per layer, the block's construction keys (decoding)."""
    construction_v: list[Tensor] = field(default_factory=list)


def run_block(model: "Beta12Transformer", x: Tensor, rope: tuple[Tensor, Tensor],
              view: HistoryView | PieceView, weights: "PassWeights", *, dropout: float,
              finished: bool, construction: bool) -> BlockOutput:
    """All layers on the tokens `x [B, n, d]` of one block, whose positions' RoPE tables are
    `rope` (cos, sin `[n, d_h]`): its layer-0 projection, then one wave of one cell per layer.

    `view` gives each layer its key set: the finished KVs of earlier blocks and, when decoding a
    partly filled block, the construction KVs of its tokens before the view's start. `weights`
    are this pass's, `dropout` the attention dropout; `finished`/`construction`: whether the
    block's finished / construction KVs are wanted (nobody reads the last block's finished KVs
    in training: its cells then project plainly).
    """
    cos, sin = rope
    top = len(model.layers) - 1
    out = BlockOutput(x)
    state, qkv = x[None], tuple(t[None] for t in enter(model, weights, Entering(x, cos, sin)))
    cos, sin = cos[None], sin[None]
    for l in range(top + 1):
        if construction:
            out.construction_k.append(qkv[1].squeeze(0))
            out.construction_v.append(qkv[2].squeeze(0))
        wave = Wave(0, [l], top, entering=False, period=top + 1, finished=finished)
        step = run_wave(model, state, qkv, [view], wave, weights, cos, sin, None,
                        dropout=dropout, copy_next=False)
        out.finished_k += [k for k, _ in step.finished]
        out.finished_v += [v for _, v in step.finished]
        state, qkv = step.x, step.qkv
        if step.hidden is not None:
            out.hidden = step.hidden
    return out


def run_blocks(model: "Beta12Transformer", x: Tensor, cos: Tensor, sin: Tensor,
               weights: "PassWeights", history: BufferedHistory | PieceHistory, *,
               dropout: float, static: bool) -> Tensor:
    """The final hidden states `[B, T, d]` of the embeddings `x [B, T, d]`, block by block;
    `cos/sin [T, d_h]`: the pass's RoPE tables, each block reads a slice (no copy). `static`:
    full blocks through the compiled or captured step (the history allocated before)."""
    c, length = model.config.block_size, x.shape[1]
    hidden = []
    # Split, not sliced per block: one concatenation in backward instead of a zero-filled
    # [B, T, d] gradient per block.
    for s, block in zip(range(0, length, c), x.split(c, dim=1)):
        e = min(s + c, length)
        rope = (cos[s:e], sin[s:e])
        if static:
            out = _static_block(model, block, rope, history.step_view(s, e - s), weights,
                                dropout=dropout)
        else:
            out = model._run(run_block, model, block, rope, history.view(s), weights,
                             dropout=dropout, finished=e < length, construction=False)
        if e < length:
            history.publish(block_cells(s, len(model.layers)), out.finished_k, out.finished_v)
        hidden.append(out.hidden)
    return torch.cat(hidden, dim=1)


def _static_block(model: "Beta12Transformer", x: Tensor, rope: tuple[Tensor, Tensor],
                  view: HistoryView, weights: "PassWeights", *, dropout: float) -> BlockOutput:
    """One block of a static pass: a full block replayed (CUDA graphs, which recompute in
    backward themselves) or through the compiled step; a ragged last block eagerly. Finished
    KVs always (the last block's are not read)."""
    kwargs = dict(dropout=dropout, finished=True, construction=False)
    full = x.shape[1] == model.config.block_size
    step = (model.compiled_step or run_block) if full else run_block
    if full and model.step_graphs is not None:

        def unit(inputs: list[Tensor], constants: list[Tensor], views: list[HistoryView],
                 weights: "PassWeights") -> tuple:
            out = step(model, inputs[0], tuple(constants), views[0], weights, **kwargs)
            return out.hidden, out.finished_k, out.finished_v

        return BlockOutput(*model.step_graphs.run(Unit(
            kind=("block", dropout), fn=unit, inputs=[x], constants=list(rope), views=[view])))
    with saved_unchecked():
        return model._run(step, model, x, rope, view, weights, **kwargs)
