"""The weights of one beta12 pass, built once from the parameters (spec §1-§3).

Each kind of weight is stacked over the layers in REVERSE order, in the dtype the pass computes
in (under autocast its dtype: one cast per pass, not one per cell): a wave's cells (layers
stepping down by the period, model/plan.py) read one strided view of a stack, a wave of one
cell the view of one (`index(l)`).

- `plain[l]`: layer l's input projection (queries, construction K/V; norm weight folded in), for
  layer 0 (a block entering); in a pass of one block (whose finished K/V nobody reads) every
  layer's;
- `next`: layers L-1 … 1's input projections, each fused with the layer below's finished K/V
  (5 projections, 2 norm weights folded in: one matmul for the finished K/V of layer l and the
  queries and construction K/V of layer l+1);
- `last_finished`: the last layer's finished K/V from the block's final hidden states;
- `out`, `gate_up`, `down`: W_O, SwiGLU's gate and up (ffn_norm folded in), w2;
- `self_bias [L]` and `shift [L, G, H]` (λ_h·(m - l) per source group: what the kernels
  subtract), float32 at least; the pass's per-row bias gradients (`BiasRows`) where the
  backends leave them.

Inside the pass's driver (model/passes.py) the weights are read from leaf tensors
(`with_tensors`): the by-hand stacks' gradients and the bias rows are handed back as the pass's
gradients (`gradients`), the rest by autograd.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from megabeta.model.attention.backend import Biases, BiasRows
from megabeta.model.config import ModelConfig
from megabeta.model.layers import (
    BranchWeights,
    ElementwiseKernels,
    Projection,
    StackedWeight,
    fused_input_rows,
    fused_stack,
)


class PassWeights:
    """One pass's weights (module doc). `finished`: whether the pass reads finished K/V (more
    than one block); `dtype`: the compute dtype to cast the stacks to (None: as they are)."""

    def __init__(self, layers: nn.ModuleList, config: ModelConfig, kernels: ElementwiseKernels,
                 *, finished: bool, dtype: torch.dtype | None = None) -> None:
        project = functools.partial(Projection, head_dim=config.head_dim, kernels=kernels,
                                    dtype=dtype)
        stack = (lambda ts: StackedWeight(torch.stack(ts) if dtype is None
                                          else torch.stack(ts).to(dtype)))
        layers = list(layers)
        self.layers = len(layers)
        self.plain = [project(layer.attention.input_rows(layer.attention_norm))
                      for layer in (layers[:1] if finished else layers)]
        self.next: Projection | None = None
        self.last_finished: Projection | None = None
        if finished:
            if len(layers) > 1:
                self.next = project([fused_input_rows(layers[l - 1], layers[l])
                                     for l in range(len(layers) - 1, 0, -1)])
            top = layers[-1]
            self.last_finished = project(top.attention.finished_rows(top.attention_norm))
        reverse = layers[::-1]
        self.out = stack([layer.attention.wo.weight for layer in reverse])
        gate_up = fused_stack([layer.feed_forward.fused_rows(layer.ffn_norm) for layer in reverse])
        self.gate_up = StackedWeight(gate_up if dtype is None else gate_up.to(dtype))
        self.down = stack([layer.feed_forward.w2.weight for layer in reverse])
        attentions = [layer.attention for layer in reverse]
        self.self_bias = (_at_least_float32(torch.cat([a.self_bias for a in attentions]))
                          if attentions[0].self_bias is not None else None)
        self.shift = _shifts(config, attentions)
        self.rows: BiasRows | None = None
        self.gradient_form = "autograd"
        self.batch = self.length = 0

    def index(self, layer: int) -> int:
        """Layer `layer`'s entry in the stacks of every layer (reverse order)."""
        return self.layers - 1 - layer

    def input(self, layer: int, finished: bool) -> Callable[..., list[Tensor]]:
        """Layer `layer`'s input projection: (normalized, cos, sin) -> its parts."""
        if finished and layer > 0:
            # `next` stacks layers L-1 … 1: layer l is entry L-1-l, as in the other stacks.
            return functools.partial(self.next, index=self.index(layer))
        return self.plain[layer]

    def branches(self, cells: slice) -> BranchWeights:
        """The residual-branch weights of the layers `cells` of the stacks."""
        return BranchWeights(self.out, self.gate_up, self.down, cells)

    def biases(self, cells: slice, *, rows_wanted: bool) -> Biases:
        """The score biases of the layers `cells` of the stacks, and where their gradient rows
        go (a by-hand pass under autograd, for a backend that leaves them: `rows_wanted`)."""
        rows = None
        if rows_wanted and self.gradient_form != "autograd" and torch.is_grad_enabled():
            if self.rows is None:
                self.rows = BiasRows.zeros(self.layers, self.shift.shape[1], self.batch,
                                           self.shift.shape[2], self.length, self.shift)
            rows = self.rows.cells(cells)
        return Biases(None if self.self_bias is None else self.self_bias[cells],
                      self.shift[cells], rows)

    def _projections(self) -> list[Projection]:
        return [*self.plain, *filter(None, [self.next, self.last_finished])]

    def tensors(self) -> list[Tensor]:
        """Every tensor the pass reads of these weights, in a fixed order."""
        return [t for p in self._projections() for t in p.tensors()] + [
            w.weight for w in (self.out, self.gate_up, self.down)] + [
            t for t in (self.self_bias, self.shift) if t is not None]

    def with_tensors(self, tensors: list[Tensor], *, gradients: str, batch: int,
                     length: int) -> "PassWeights":
        """These weights reading `tensors` (in `tensors()`'s order) instead, for a pass of
        `batch` sequences of `length` (padded) tokens; `gradients`: how the stacks' gradients
        are formed (`StackedWeight`; by hand, `"pass"` or `"call"`, the bias rows are kept by
        hand too and `gradients()` hands them back)."""
        it: Iterator[Tensor] = iter(tensors)
        other = copy.copy(self)
        other.plain = [p.with_tensors(it, gradients=gradients) for p in self.plain]
        other.next, other.last_finished = (
            None if p is None else p.with_tensors(it, gradients=gradients)
            for p in (self.next, self.last_finished))
        other.out, other.gate_up, other.down = (StackedWeight(next(it), gradients=gradients)
                                                for _ in range(3))
        if self.self_bias is not None:
            other.self_bias = next(it)
        other.shift = next(it)
        if next(it, None) is not None:
            raise ValueError("PassWeights.with_tensors: more tensors than the weights read")
        other.gradient_form, other.batch, other.length = gradients, batch, length
        other.rows = None
        return other

    def _stacks(self) -> list[StackedWeight]:
        return [w for p in self._projections() for w in (p.weight, p.bias) if w is not None] + [
            self.out, self.gate_up, self.down]

    def start_backward(self) -> None:
        """Forget what an earlier backward of the pass kept by hand (a replayed capture)."""
        for stack in self._stacks():
            stack.forget()
        if self.rows is not None:
            self.rows.shift.zero_()
            self.rows.diag.zero_()

    def gradients(self) -> list[Tensor | None]:
        """The by-hand gradients, in `tensors()`'s order (None where autograd forms them); the
        rows the stacks kept are let go once they are formed (a pass's rows are most of its
        memory, model/memory.py)."""
        grads = [g for p in self._projections() for g in p.gradients()]
        grads += [w.gradient() for w in (self.out, self.gate_up, self.down)]
        for stack in self._stacks():
            stack.forget()
        shift = self_bias = None
        if self.rows is not None:
            shift, self_bias = self.rows.gradients()
        if self.self_bias is not None:
            grads.append(None if self_bias is None else self_bias.to(self.self_bias.dtype))
        grads.append(None if shift is None else shift.to(self.shift.dtype))
        return grads


def _at_least_float32(t: Tensor) -> Tensor:
    """`t` in float32, or as it is when wider (the kernels add the biases in their
    accumulation's precision; a float64 model's stay exact)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _shifts(config: ModelConfig, attentions: list[nn.Module]) -> Tensor:
    """λ_h·(m - l) per layer (reverse order), source group and head `[L, G, H]` (zero past a
    layer's groups, and without a depth bias), in λ's precision (at least float32)."""
    layers = len(attentions)
    sources = [config.source_layers(l) for l in range(layers)]
    width = max(1, max(map(len, sources)))
    weight = attentions[0].wq.weight
    # λ = lambda_max·sigmoid(θ) (`Attention.depth_slope`) for every layer at once.
    slope = (config.lambda_max * torch.sigmoid(torch.stack([a.depth_bias for a in attentions]))
             if config.depth_window > 0 and config.depth_bias else None)
    dtype = torch.promote_types(weight.dtype if slope is None else slope.dtype, torch.float32)
    offsets = torch.tensor([[m - l for m in sources[l]] + [0] * (width - len(sources[l]))
                            for l in range(layers - 1, -1, -1)], dtype=dtype,
                           device=weight.device)
    if slope is None:
        return offsets.new_zeros(*offsets.shape, config.num_heads)
    return offsets[:, :, None] * slope.to(dtype)[:, None, :]


__all__ = ["PassWeights"]
