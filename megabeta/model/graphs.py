"""A beta12 pass as two CUDA graphs (`execution.cuda_graphs = true`): its forward, and its
backward with the recomputation, each captured once per shape and replayed as ONE launch.

At c = 32 a 16K-token sequence is 2048 (block, layer) cells, each some thirty kernels forward,
again when recomputed and in backward: launched one by one from Python, the step is bound by
the host (docs/benchmarks/). Captured, the host work of a micro-step is a fixed number of
copies and two replays, whatever the number of cells (Megatron-Core's full-iteration graphs do
the same for a whole step). What is captured is the pass's driver (model/passes.py) as it runs
eagerly: its forward without autograd, keeping each unit's inputs; its backward walking the
units back, each recomputed under autograd and differentiated at once. Collectives stay
outside: FSDP2 gathers the parameters before the pass (its root's pre-forward hook) and
reduces their gradients after it, DDP likewise.

A graph replays its kernels at the addresses it was captured with, so everything the pass reads
lives at fixed addresses (`GraphedRun`): the embeddings, the pass's weight tensors and the
document starts are copied in (one multi-tensor copy per dtype, `copy_all`), the history, the
RoPE tables and every buffer the driver keeps are the run's own; the outputs (hidden states;
gradients of the embeddings and weights) are copied out. One run per (batch, length, dtype,
autocast, documents), each with its own memory pool.

The capture itself is a `Capture`: CUDA graphs on a GPU (`CudaCapture`); on a CPU the tests put
`EagerCapture` in its place, which calls the function again instead of replaying it and counts
both, so that the fixed tensors, the copies and the replay counts are checked without a GPU.
"""

from __future__ import annotations

from typing import Callable, Hashable, Protocol, Sequence

import torch
from torch import Tensor

from megabeta.kernels.multi_tensor import cloned, copy_all
from megabeta.model.passes import Driver, PassRun


class Capture(Protocol):
    """Records a function of fixed tensors and returns what replays it."""

    def capture(self, fn: Callable[[], None], pool: object) -> Callable[[], None]:
        """`fn` has just run eagerly (which warmed it up); return its replay."""

    def pool(self) -> object:
        """A memory pool for one run's graphs."""


class CudaCapture:
    """`torch.cuda.CUDAGraph`s; a run's two share a pool (its forward's buffers live on)."""

    def __init__(self) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], None], pool: object) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        self.graphs.append(graph)
        return graph.replay


class EagerCapture:
    """A stand-in for CPU tests: the "replay" runs the function again; captures and replays
    counted."""

    def __init__(self) -> None:
        self.captured = 0
        self.replays = 0

    def pool(self) -> object:
        return None

    def capture(self, fn: Callable[[], None], pool: object) -> Callable[[], None]:
        self.captured += 1

        def replay() -> None:
            self.replays += 1
            fn()

        return replay


class GraphedRun(PassRun):
    """One shape's pass as two graphs (module doc). `driver` is built over this run's fixed
    tensors (`x`, `tensors`, `documents`), which each call copies its inputs into."""

    def __init__(self, capture: Capture, driver: Driver, x: Tensor, tensors: list[Tensor],
                 documents: Tensor | None) -> None:
        self.capture, self.driver = capture, driver
        self.x, self.tensors, self.documents = x, tensors, documents
        self.pool = capture.pool()
        self._forward: Callable[[], None] | None = None
        self._backward: Callable[[], None] | None = None
        self.hidden: Tensor | None = None
        self.d_hidden: Tensor | None = None
        self.d_x: Tensor | None = None
        self.grads: list[Tensor | None] = []

    def copy_in(self, x: Tensor, tensors: list[Tensor], documents: Tensor | None) -> None:
        fixed = [self.x, *self.tensors, *([] if documents is None else [self.documents])]
        given = [x, *tensors, *([] if documents is None else [documents])]
        with torch.no_grad():
            copy_all(fixed, given)

    def forward(self, x: Tensor, tensors: list[Tensor], *, keep: bool) -> Tensor:
        # `copy_in` ran (`PassGraphs.run`); the graph keeps what backward needs whatever `keep`.
        if self._forward is None:
            def forward() -> None:
                self.hidden = self.driver.forward(self.x, self.tensors, keep=True)

            forward()
            self._forward = self.capture.capture(forward, self.pool)
        self._forward()
        return self.hidden.clone()

    def backward(self, d_hidden: Tensor) -> tuple[Tensor, list[Tensor | None]]:
        if self.d_hidden is None:
            self.d_hidden = torch.empty_like(d_hidden)
        with torch.no_grad():
            self.d_hidden.copy_(d_hidden)
        if self._backward is None:
            def backward() -> None:
                self.d_x, self.grads = self.driver.backward(self.d_hidden)

            backward()
            self._backward = self.capture.capture(backward, self.pool)
        self._backward()
        present = [g for g in self.grads if g is not None]
        copies = iter(cloned([self.d_x, *present]))
        d_x = next(copies)
        return d_x, [None if g is None else next(copies) for g in self.grads]


class PassGraphs:
    """The graphed runs of one model, by shape (module doc)."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self.runs: dict[Hashable, GraphedRun] = {}

    def run(self, key: Hashable, x: Tensor, tensors: list[Tensor], documents: Tensor | None,
            make_driver: Callable[[Tensor | None], Driver]) -> GraphedRun:
        """The run for `key` (made on first use: fixed copies of `x`, `tensors`, `documents`
        and a driver over them, `make_driver(fixed documents)`), with the inputs copied in."""
        run = self.runs.get(key)
        if run is None:
            fixed_x = torch.empty_like(x)
            fixed = [torch.empty_like(t) for t in tensors]
            fixed_documents = None if documents is None else torch.empty_like(documents)
            run = GraphedRun(self.capture, make_driver(fixed_documents), fixed_x, fixed,
                             fixed_documents)
            self.runs[key] = run
        run.copy_in(x, tensors, documents)
        return run


__all__ = ["Capture", "CudaCapture", "EagerCapture", "GraphedRun", "PassGraphs", "cloned",
           "copy_all"]
