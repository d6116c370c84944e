"""CUDA graphs of a beta12 pass's recompute units (`execution.cuda_graphs = true`): the block
step of the block schedule, the wave step of the wavefront.

A block step is a few hundred kernels; at c = 32 a 16K-token sequence runs 512 of them per
forward, again in backward, and a wavefront pass its waves likewise. Captured once and
replayed per unit, each costs one launch from the host. Two graphs per kind of unit (a block: one kind;
a wave: its layers, whether a block leaves or enters, `wavefront.WavePlan.kinds`), kept per
(history shape, dtype, device, autocast):

- forward: the unit without autograd (checkpointing per block or wave saves nothing but the
  unit's inputs), writing its outputs into fixed tensors;
- backward: the recompute with autograd and its backward, from fixed output gradients: the
  inputs' gradients into fixed tensors, the pass weights' gradients ADDED into fixed
  accumulators, the history's gradients added into its gradient buffers (by the attention
  kernels, as in eager mode).

A graph replays the kernels at the addresses it was captured with, so everything a unit reads
lives at fixed addresses: its inputs, RoPE tables, its cells' starts and document bounds
(copied in per unit), the pass's weights (copied in once per pass, `begin_pass`), and the
history buffers, which `StepGraphs` owns across steps (`history_buffers`). The history's
publish, the ordering anchors and FSDP's collectives stay outside the graphs, in eager code
between units.

`_GraphedUnit` is the autograd node of one unit: its backward replays the backward graph; the
last unit of a pass to run backward (counted down from `begin_pass`'s `units`; for blocks,
block 0, which waits for every later reader, history.py) hands the accumulated weight
gradients to the pass's weights.

The capture itself is a `Capture`: CUDA graphs on a GPU (`CudaCapture`); on a CPU the tests
put `EagerCapture` in its place, which calls the function again instead of replaying it, so
that everything around the graphs (the fixed tensors, the copies, the gradient hand-out) is
checked against the eager loop without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol, Sequence

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from megabeta.model.history import HistoryView


class Capture(Protocol):
    """Records a function of fixed tensors once and returns what replays it."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """`fn` has just run eagerly (which warmed it up); return its replay."""


class CudaCapture:
    """`torch.cuda.CUDAGraph`s sharing one memory pool (one unit's work is alive at a time)."""

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


UnitFn = Callable[[list[Tensor], list[Tensor], list[HistoryView], Any], Any]
"""One recompute unit: (inputs, constants, views, weights) -> a pytree of tensors (None
allowed), the same structure for every call of one kind. `inputs` are differentiable,
`constants` not (RoPE tables); `views` read the history's buffers at their tensor starts."""


@dataclass(frozen=True)
class Unit:
    """One call of a recompute unit (`StepGraphs.run`)."""

    kind: Hashable
    """Everything `fn` reads besides the tensors: units of one kind share their graphs."""
    fn: UnitFn
    inputs: Sequence[Tensor]
    constants: Sequence[Tensor]
    views: Sequence[HistoryView]


def copy_all(dst: Sequence[Tensor], src: Sequence[Tensor]) -> None:
    """`d.copy_(s)` for each pair, one multi-tensor launch per pair of dtypes
    (`torch._foreach_copy_`): the copies around a replayed unit are a dozen small tensors, and
    on a GPU each would be a launch of its own, at about the cost of the copy."""
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
    for d, s in zip(dst, src, strict=True):
        to, of = groups.setdefault((d.dtype, s.dtype), ([], []))
        to.append(d)
        of.append(s)
    for to, of in groups.values():
        torch._foreach_copy_(to, of)


def cloned(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Copies of `tensors` in their layouts (`copy_all`: one launch per dtype)."""
    out = [torch.empty_like(t) for t in tensors]
    copy_all(out, tensors)
    return out


@dataclass(eq=False)
class _Graphs:
    """The fixed tensors of one kind of unit and its two replays."""

    inputs: list[Tensor]
    constants: list[Tensor]
    starts: list[Tensor]
    documents: list[Tensor | None]
    """Each view's document bounds `[B, c]` (spec §7), when the captured graphs read them."""
    views: list[HistoryView]
    outputs: list[Tensor] = field(default_factory=list)
    spec: pytree.TreeSpec | None = None
    """The outputs' structure (`fn`'s pytree), whose leaves are `outputs` and Nones."""
    present: list[bool] = field(default_factory=list)
    """Which of its leaves are tensors (`outputs`, in order)."""
    output_grads: list[Tensor] = field(default_factory=list)
    input_grads: list[Tensor] = field(default_factory=list)
    forward: Callable[[], None] | None = None
    backward: Callable[[], None] | None = None


@dataclass(eq=False)
class _Pass:
    """What units of every kind share, per (history shape, dtype, device, autocast)."""

    history: tuple[Tensor, Tensor, Tensor, Tensor]
    """Keys, values and their float32 gradient buffers `[L, B, H_kv, T, d_h]`."""
    autocast: tuple[str, bool, torch.dtype]
    """The forward's autocast state (device type, on, dtype): both graphs run under it, also
    the backward's recompute, which autograd calls outside the forward's context."""
    weights: list[Tensor] = field(default_factory=list)
    """The pass's weights, leaves that ask for gradients (the backward graphs' inputs)."""
    weight_grads: list[Tensor] = field(default_factory=list)
    kinds: dict[Hashable, _Graphs] = field(default_factory=dict)


class StepGraphs:
    """The captured recompute units of one model (module doc)."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self._passes: dict[tuple, _Pass] = {}
        self._current: _Pass | None = None
        self._fixed_weights: Any = None
        """This pass's weights (`PassWeights`) reading the fixed tensors."""
        self._weight_inputs: list[Tensor] = []
        """The current pass's weight tensors (`PassWeights.tensors()`), inputs of every unit."""
        self._pending = 0
        """Units of the current pass whose backward has not run yet."""

    # ---- per pass -------------------------------------------------------------------------------
    def history_buffers(self, shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The history buffers for a pass of this shape (kept across passes; the gradient
        buffers zeroed), and the shape's fixed tensors made current."""
        autocast = (device.type, torch.is_autocast_enabled(device.type),
                    torch.get_autocast_dtype(device.type))
        key = (shape, dtype, device, autocast)
        current = self._passes.get(key)
        if current is None:
            empty = dict(dtype=dtype, device=device)
            grads = dict(dtype=torch.promote_types(dtype, torch.float32), device=device)
            current = _Pass(history=(torch.empty(shape, **empty), torch.empty(shape, **empty),
                                     torch.zeros(shape, **grads), torch.zeros(shape, **grads)),
                            autocast=autocast)
            self._passes[key] = current
        else:
            current.history[2].zero_()
            current.history[3].zero_()
        self._current = current
        return current.history

    def begin_pass(self, weights: Any, units: int) -> None:
        """Copy this pass's weights (`PassWeights`) to the fixed ones; `units` graphed units
        will run."""
        current = self._current
        # Listed once per pass: `run` hands them to every unit's node (the hot path).
        self._weight_inputs = weights.tensors()
        tensors = [t.detach() for t in self._weight_inputs]
        if not current.weights:
            current.weights = [t.clone().requires_grad_() for t in tensors]
            current.weight_grads = [torch.zeros_like(t) for t in tensors]
        else:
            with torch.no_grad():
                copy_all(current.weights, tensors)
            torch._foreach_zero_(current.weight_grads)
        self._fixed_weights = weights.with_tensors(current.weights)
        self._pending = units

    def run(self, unit: Unit) -> Any:
        """One unit: `fn`'s outputs, differentiable w.r.t. its inputs and the pass's weights
        (through `_GraphedUnit`)."""
        anchors = [view.anchor for view in unit.views if view.anchor is not None]
        outs = _GraphedUnit.apply(self, unit, len(anchors), *unit.inputs, *anchors,
                                  *self._weight_inputs)
        # The kind's graphs, as the forward just chose them.
        graphs = self._current.kinds[unit.kind]
        outs = iter(outs)
        return pytree.tree_unflatten([next(outs) if tensor else None
                                      for tensor in graphs.present], graphs.spec)

    # ---- the two graphs -------------------------------------------------------------------------
    def _graphs(self, unit: Unit) -> _Graphs:
        graphs = self._current.kinds.get(unit.kind)
        documents = [view.lower for view in unit.views]
        if graphs is not None and any((d is None) != (g is None)
                                      for d, g in zip(documents, graphs.documents)):
            # Graphs captured with a document mask read other tensors than those without.
            graphs = None
        if graphs is None:
            keys, values, *grads = self._current.history
            starts = [torch.empty_like(view.start) for view in unit.views]
            fixed_documents = [None if d is None else torch.empty_like(d) for d in documents]
            graphs = _Graphs(
                inputs=[torch.empty_like(t) for t in unit.inputs],
                constants=[torch.empty_like(t) for t in unit.constants],
                starts=starts, documents=fixed_documents,
                views=[HistoryView(view.history, keys, values, start, None, None,
                                   grads=tuple(grads), lower=lower)
                       for view, start, lower in zip(unit.views, starts, fixed_documents)])
            self._current.kinds[unit.kind] = graphs
        return graphs

    def _copy_in(self, unit: Unit) -> _Graphs:
        graphs = self._graphs(unit)
        documents = [(fixed, view.lower) for fixed, view in zip(graphs.documents, unit.views)
                     if fixed is not None]
        copy_all([*graphs.inputs, *graphs.constants, *graphs.starts, *(f for f, _ in documents)],
                 [*unit.inputs, *unit.constants, *(v.start for v in unit.views),
                  *(d for _, d in documents)])
        return graphs

    def _call(self, unit: Unit, graphs: _Graphs, inputs: list[Tensor]) -> Any:
        return unit.fn(inputs, graphs.constants, graphs.views, self._fixed_weights)

    def forward(self, unit: Unit) -> list[Tensor]:
        graphs = self._copy_in(unit)
        if graphs.forward is None:
            def forward() -> None:
                with torch.no_grad(), _autocast(self._current):
                    leaves, graphs.spec = pytree.tree_flatten(self._call(unit, graphs,
                                                                         graphs.inputs))
                    graphs.present = [t is not None for t in leaves]
                    outs = [t for t in leaves if t is not None]
                    if not graphs.outputs:
                        graphs.outputs = [torch.empty_like(t) for t in outs]
                    copy_all(graphs.outputs, outs)

            forward()
            graphs.forward = self.capture.capture(forward)
        else:
            graphs.forward()
        return cloned(graphs.outputs)

    def backward(self, unit: Unit, grads: Sequence[Tensor | None]
                 ) -> tuple[list[Tensor], list[Tensor] | None]:
        """The inputs' gradients, and, at the last unit of the pass, the weights'."""
        graphs = self._copy_in(unit)
        current = self._current
        if not graphs.output_grads:
            graphs.output_grads = [torch.zeros_like(t) for t in graphs.outputs]
        given = [(fixed, grad) for fixed, grad in zip(graphs.output_grads, grads)
                 if grad is not None]
        copy_all([f for f, _ in given], [g for _, g in given])
        missing = [fixed for fixed, grad in zip(graphs.output_grads, grads) if grad is None]
        if missing:
            torch._foreach_zero_(missing)
        if graphs.backward is None:
            def backward() -> None:
                with torch.enable_grad(), _autocast(current):
                    leaves = [t.detach().requires_grad_() for t in graphs.inputs]
                    outs = [t for t in pytree.tree_leaves(self._call(unit, graphs, leaves))
                            if t is not None]
                    found = torch.autograd.grad(outs, [*leaves, *current.weights],
                                                graphs.output_grads, allow_unused=True)
                if not graphs.input_grads:
                    graphs.input_grads = [torch.zeros_like(t) for t in leaves]
                for fixed, grad in zip(graphs.input_grads, found):
                    if grad is not None:
                        fixed.copy_(grad)
                for acc, grad in zip(current.weight_grads, found[len(leaves):]):
                    if grad is not None:
                        acc.add_(grad)

            backward()
            graphs.backward = self.capture.capture(backward)
        else:
            graphs.backward()
        self._pending -= 1
        weight_grads = None
        if self._pending == 0:
            weight_grads = cloned(current.weight_grads)
        return cloned(graphs.input_grads), weight_grads


def _autocast(current: _Pass) -> torch.autocast:
    kind, enabled, dtype = current.autocast
    return torch.autocast(kind, dtype=dtype, enabled=enabled)


class _GraphedUnit(torch.autograd.Function):
    """One unit through the captured graphs (module doc). Inputs: the unit's differentiable
    inputs, its views' anchors (ordering only), then the pass's weights (whose gradients the
    pass's last unit hands out). The constants and views travel in `unit`: no gradient."""

    @staticmethod
    def forward(ctx: Any, graphs: StepGraphs, unit: Unit, anchors: int,
                *tensors: Tensor) -> tuple[Tensor, ...]:
        outs = graphs.forward(unit)
        ctx.graphs, ctx.unit, ctx.anchors = graphs, unit, anchors
        ctx.weights = len(tensors) - len(unit.inputs) - anchors
        ctx.save_for_backward(*unit.inputs, *unit.constants)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        unit = ctx.unit
        saved = ctx.saved_tensors
        inputs = len(unit.inputs)
        # The saved tensors, checked by autograd against in-place changes since the forward.
        unit = Unit(unit.kind, unit.fn, saved[:inputs], saved[inputs:], unit.views)
        input_grads, weight_grads = ctx.graphs.backward(unit, grads)
        weights = weight_grads if weight_grads is not None else [None] * ctx.weights
        # No gradient for the anchors: their edges alone order autograd (history.py).
        return (None, None, None, *input_grads, *[None] * ctx.anchors, *weights)
