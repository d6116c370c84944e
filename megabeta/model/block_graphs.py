"""CUDA graphs of the beta12 block step (`execution.cuda_graphs = true`).

A block step is a few hundred kernels; at c = 32 a 16K-token sequence runs 512 of them per
forward, again in backward. Captured once and replayed per block, each costs one launch from
the host. Two graphs per (batch, length, dtype):

- forward: the block through all layers without autograd (block checkpointing saves nothing
  but the block's input), writing the hidden states and finished K/V into fixed outputs;
- backward: the recompute with autograd and its backward, from fixed output gradients: the
  input's gradient into a fixed tensor, the pass weights' gradients ADDED into fixed
  accumulators, the history's gradients added into its gradient buffers (by the attention
  kernels, as in eager mode).

A graph replays the kernels at the addresses it was captured with, so everything the step
reads lives at fixed addresses: the block's input, RoPE tables and start (copied in per block),
the pass's weights (copied in once per pass, `begin_pass`), and the history buffers, which
`BlockGraphs` owns across steps (`history_buffers`). The history's publish, the ordering
anchors and FSDP's collectives stay outside the graphs, in eager code between blocks.

`_GraphedBlock` is the autograd node of one block: its backward replays the backward graph; the
last block's backward of a pass (autograd runs block 0's last: it waits for every later
reader, history.py) hands the accumulated weight gradients to the pass's weights.

The capture itself is a `Capture`: CUDA graphs on a GPU (`CudaCapture`); on a CPU the tests
put `EagerCapture` in its place, which calls the function again instead of replaying it, so
that everything around the graphs (the fixed tensors, the copies, the gradient hand-out) is
checked against the eager loop without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from megabeta.model.history import HistoryView


class Capture(Protocol):
    """Records a function of fixed tensors once and returns what replays it."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """`fn` has just run eagerly (which warmed it up); return its replay."""


class CudaCapture:
    """`torch.cuda.CUDAGraph`s sharing one memory pool (one block's work is alive at a time)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        self.graphs.append(graph)
        return graph.replay


class EagerCapture:
    """A stand-in for CPU tests: the "replay" runs the function again."""

    def __init__(self) -> None:
        self.captured = 0

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        self.captured += 1
        return fn


StepFn = Callable[..., Any]
"""`Beta12Transformer._block` (or its compiled version): (x, (cos, sin), view, weights, *,
dropout, finished, construction) -> BlockOutput."""


@dataclass(eq=False)
class _Shape:
    """The fixed tensors of one (batch, length, dtype) and its two replays."""

    x: Tensor
    cos: Tensor
    sin: Tensor
    start: Tensor
    history: tuple[Tensor, Tensor, Tensor, Tensor]
    """Keys, values and their float32 gradient buffers `[L, B, H_kv, T, d_h]`."""
    autocast: tuple[str, bool, torch.dtype]
    """The forward's autocast state (device type, on, dtype): both graphs run under it, also
    the backward's recompute, which autograd calls outside the forward's context."""
    documents: Tensor | None = None
    """The block's document bounds `[B, c]` (spec §7), when the captured graphs read them."""
    weights: list[Tensor] = field(default_factory=list)
    """The pass's weights, leaves that ask for gradients (the backward graph's inputs)."""
    weight_grads: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    """Hidden states, then the finished keys and values per layer."""
    output_grads: list[Tensor] = field(default_factory=list)
    input_grad: Tensor | None = None
    forward: Callable[[], None] | None = None
    backward: Callable[[], None] | None = None


class BlockGraphs:
    """The captured block step of one model (module doc)."""

    def __init__(self, step: StepFn, capture: Capture) -> None:
        self.step, self.capture = step, capture
        self._shapes: dict[tuple, _Shape] = {}
        self._current: _Shape | None = None
        self._weight_inputs: list[Tensor] = []
        """The current pass's weight tensors (`PassWeights.tensors()`), inputs of every block."""
        self._pending = 0
        """Blocks of the current pass whose backward has not run yet."""

    # ---- per pass -------------------------------------------------------------------------------
    def history_buffers(self, shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The history buffers for a pass of this shape (kept across passes; the gradient
        buffers zeroed), and the shape's fixed tensors made current."""
        autocast = (device.type, torch.is_autocast_enabled(device.type),
                     torch.get_autocast_dtype(device.type))
        key = (shape, dtype, device, autocast)
        current = self._shapes.get(key)
        if current is None:
            layers, batch, heads, length, width = shape
            empty = dict(dtype=dtype, device=device)
            grads = dict(dtype=torch.promote_types(dtype, torch.float32), device=device)
            current = _Shape(
                x=torch.empty(0), cos=torch.empty(0), sin=torch.empty(0),
                start=torch.zeros((), dtype=torch.int64, device=device),
                history=(torch.empty(shape, **empty), torch.empty(shape, **empty),
                         torch.zeros(shape, **grads), torch.zeros(shape, **grads)),
                autocast=autocast)
            self._shapes[key] = current
        else:
            current.history[2].zero_()
            current.history[3].zero_()
        self._current = current
        return current.history

    def begin_pass(self, weights: Any, blocks: int) -> None:
        """Copy this pass's weights (`PassWeights`) to the fixed ones; `blocks` graphed blocks
        will run."""
        current = self._current
        # Listed once per pass: `run` hands them to every block's node (the hot path).
        self._weight_inputs = weights.tensors()
        tensors = [t.detach() for t in self._weight_inputs]
        if not current.weights:
            current.weights = [t.clone().requires_grad_() for t in tensors]
            current.weight_grads = [torch.zeros_like(t) for t in tensors]
        else:
            with torch.no_grad():
                for fixed, t in zip(current.weights, tensors):
                    fixed.copy_(t)
            for grad in current.weight_grads:
                grad.zero_()
        self._fixed_weights = weights.with_tensors(current.weights)
        self._pending = blocks

    def run(self, x: Tensor, rope: tuple[Tensor, Tensor], view: HistoryView,
            **kwargs: Any) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """One block: hidden states and finished K/V per layer, differentiable w.r.t. `x`
        and the pass's weights (through `_GraphedBlock`)."""
        outs = _GraphedBlock.apply(self, kwargs, view, x, rope[0], rope[1], view.anchor,
                                   *self._weight_inputs)
        layers = (len(outs) - 1) // 2
        return outs[0], list(outs[1:1 + layers]), list(outs[1 + layers:])

    # ---- the two graphs -------------------------------------------------------------------------
    def _copy_in(self, x: Tensor, cos: Tensor, sin: Tensor, view: HistoryView) -> _Shape:
        current = self._current
        if current.x.shape != x.shape:
            current.x, current.cos, current.sin = (torch.empty_like(t) for t in (x, cos, sin))
        documents = view.lower
        if (documents is None) != (current.documents is None):
            # Graphs captured with a document mask read other tensors than those without.
            current.documents = None if documents is None else torch.empty_like(documents)
            current.forward = current.backward = None
        current.x.copy_(x)
        current.cos.copy_(cos)
        current.sin.copy_(sin)
        current.start.copy_(view.start)
        if documents is not None:
            current.documents.copy_(documents)
        return current

    def _view(self, current: _Shape, like: HistoryView) -> HistoryView:
        """A view of the fixed tensors that reads like `like` (a static step's view of the
        pass's history)."""
        keys, values, *grads = current.history
        return HistoryView(like.history, keys, values, current.start, None, None,
                           grads=tuple(grads), lower=current.documents)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, view: HistoryView,
                kwargs: dict) -> list[Tensor]:
        current = self._copy_in(x, cos, sin, view)
        if current.forward is None:
            fixed_view = self._view(current, view)

            def forward() -> None:
                with torch.no_grad(), _autocast(current):
                    out = self.step(current.x, (current.cos, current.sin), fixed_view,
                                    self._fixed_weights, **kwargs)
                    outs = [out.hidden, *out.finished_k, *out.finished_v]
                    if not current.outputs:
                        current.outputs = [torch.empty_like(t) for t in outs]
                    for fixed, t in zip(current.outputs, outs):
                        fixed.copy_(t)

            forward()
            current.forward = self.capture.capture(forward)
        else:
            current.forward()
        return [t.clone() for t in current.outputs]

    def backward(self, x: Tensor, cos: Tensor, sin: Tensor, view: HistoryView, kwargs: dict,
                 grads: list[Tensor | None]) -> tuple[Tensor, list[Tensor] | None]:
        """The input's gradient, and, at the last block of the pass, the weights'."""
        current = self._copy_in(x, cos, sin, view)
        if not current.output_grads:
            current.output_grads = [torch.zeros_like(t) for t in current.outputs]
        for fixed, grad in zip(current.output_grads, grads):
            if grad is None:
                fixed.zero_()
            else:
                fixed.copy_(grad)
        if current.backward is None:
            fixed_view = self._view(current, view)

            def backward() -> None:
                with torch.enable_grad(), _autocast(current):
                    leaf = current.x.detach().requires_grad_()
                    out = self.step(leaf, (current.cos, current.sin), fixed_view,
                                    self._fixed_weights, **kwargs)
                    outs = [out.hidden, *out.finished_k, *out.finished_v]
                    found = torch.autograd.grad(outs, [leaf, *current.weights],
                                                current.output_grads, allow_unused=True)
                if current.input_grad is None:
                    current.input_grad = torch.empty_like(found[0])
                current.input_grad.copy_(found[0])
                for acc, grad in zip(current.weight_grads, found[1:]):
                    if grad is not None:
                        acc.add_(grad)

            backward()
            current.backward = self.capture.capture(backward)
        else:
            current.backward()
        self._pending -= 1
        weight_grads = None
        if self._pending == 0:
            weight_grads = [g.clone() for g in current.weight_grads]
        return current.input_grad.clone(), weight_grads


def _autocast(shape: _Shape) -> torch.autocast:
    kind, enabled, dtype = shape.autocast
    return torch.autocast(kind, dtype=dtype, enabled=enabled)


class _GraphedBlock(torch.autograd.Function):
    """One block through the captured graphs (module doc). Inputs: the block's x and RoPE
    tables, the anchor (ordering only), then the pass's weights (whose gradients the pass's
    last block hands out)."""

    @staticmethod
    def forward(ctx: Any, graphs: BlockGraphs, kwargs: dict, view: HistoryView, x: Tensor,
                cos: Tensor, sin: Tensor, anchor: Tensor | None,
                *weights: Tensor) -> tuple[Tensor, ...]:
        outs = graphs.forward(x, cos, sin, view, kwargs)
        ctx.graphs, ctx.kwargs, ctx.view = graphs, kwargs, view
        ctx.save_for_backward(x, cos, sin)
        ctx.weights = len(weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        x, cos, sin = ctx.saved_tensors
        dx, weight_grads = ctx.graphs.backward(x, cos, sin, ctx.view, ctx.kwargs, list(grads))
        weights = weight_grads if weight_grads is not None else [None] * ctx.weights
        # No gradient for the anchor: its edge alone orders autograd (history.py).
        return (None, None, None, dx, None, None, None, *weights)
