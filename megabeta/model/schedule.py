"""beta12's schedules: orders of a training pass's (block, layer) cells (spec §5), each
computing the same function (tested bit for bit where the arithmetic is the same).

A schedule is one module with a `run` function over a pass's embeddings, weights and history,
and one entry of `SCHEDULES`, which also makes its name a valid `execution.schedule`. Everything
that differs between schedules is declared here, once: the recompute unit, whether a unit
batches cells of several layers, how many units a pass runs, what `execution.compile` compiles
and which attention capability its static step needs. `Beta12Transformer.forward` reads the
entry; nothing else asks which schedule runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from megabeta.model.block_schedule import run_block, run_blocks
from megabeta.model.wave import run_wave
from megabeta.model.wavefront import run_wavefront, wave_plan

if TYPE_CHECKING:  # only for annotations: beta12 imports this module
    from megabeta.model.beta12 import Beta12Transformer


@dataclass(frozen=True)
class Schedule:
    """One schedule's declaration (module doc)."""

    name: str
    run: Callable[..., Tensor]
    """(model, x, cos, sin, weights, history, *, dropout, static) -> the final hidden states
    `[B, T, d]` of the embeddings `x [B, T, d]`, T > c."""
    unit: str
    """The recompute unit: the `execution.activation_checkpoint` that recomputes one in backward,
    and that `execution.cuda_graphs` replays."""
    batched: bool
    """Whether a unit stacks cells of several layers: the pass is padded to whole blocks and
    its weights and biases are read as stacks (beta12.PassWeights)."""
    units: Callable[["Beta12Transformer", int], int]
    """How many units of a pass of this many tokens run the static step (compiled, graphed)."""
    compile: Callable[["Beta12Transformer"], Callable[..., Any]]
    """Its step, `torch.compile`d (`execution.compile`, beta12 `compile_steps`)."""
    static_capability: str
    """The attention `Capabilities` field its static step needs."""
    static_needs: str
    """What that asks of the backend, for the error that refuses one without it."""


SCHEDULES: dict[str, Schedule] = {
    "block": Schedule(
        name="block", run=run_blocks, unit="block", batched=False,
        units=lambda model, length: length // model.config.block_size,
        # Every full block through ONE graph: nothing the graph sees differs between blocks but
        # tensor contents (the history's static views, the start a tensor).
        compile=lambda model: torch.compile(run_block, fullgraph=True),
        static_capability="static_step",
        static_needs="runs the block step from fixed buffers, which needs an attention backend "
                     "that reads the history at a start held in a tensor (cpu_fused or triton)"),
    "wavefront": Schedule(
        name="wavefront", run=run_wavefront, unit="wave", batched=True,
        units=lambda model, length: wave_plan(model, length).waves,
        # One graph per kind of wave (`WavePlan.kinds`); never one generalised over the layers.
        compile=lambda model: torch.compile(run_wave, fullgraph=True, dynamic=False),
        static_capability="static_waves",
        static_needs="runs each kind of wave through one graph, which needs an attention "
                     "backend that reads a wave's cells in one call at starts held in a tensor "
                     "(triton), or execution.schedule = block"),
}
"""The schedules by `execution.schedule` name."""


__all__ = ["Schedule", "SCHEDULES"]
