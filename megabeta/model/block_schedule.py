"""The block schedule of a beta12 pass (spec §5): block by block, each through all layers.

Each block runs the model's block step (`Beta12Transformer._block`: all layers on one block's
tokens) and publishes its finished K/V, which every later block reads. With
`activation_checkpoint = block` a block is the recompute unit. A static pass (`execution.compile`
or `cuda_graphs`) runs every full block through the compiled step or its CUDA graphs
(step_graphs.py), reading the history's static views; a ragged last block runs eagerly (it
would be a second graph).
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
    block_cells,
    saved_unchecked,
)
from megabeta.model.step_graphs import Unit

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
            out = model._run(model._block, block, rope, history.view(s), weights,
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
    step = (model.compiled_step or model._block) if full else model._block
    if full and model.step_graphs is not None:

        def unit(inputs: list[Tensor], constants: list[Tensor], views: list[HistoryView],
                 weights: "PassWeights") -> tuple:
            out = step(inputs[0], tuple(constants), views[0], weights, **kwargs)
            return out.hidden, out.finished_k, out.finished_v

        return BlockOutput(*model.step_graphs.run(Unit(
            kind=("block", dropout), fn=unit, inputs=[x], constants=list(rope), views=[view])))
    with saved_unchecked():
        return model._run(step, x, rope, view, weights, **kwargs)
