"""How a model's passes run: the one place `ExecutionConfig`'s execution settings are read.

Built once when the model is placed on its device (`DecoderLM._select_kernels`), held by the
model, and applied in a fixed order to beta12's recompute unit (model/plan.py: a block, or a
wave of the wavefront):

1. activation checkpointing (`activation_checkpoint`): the pass's driver recomputes each unit in
   backward instead of keeping its graph (model/passes.py);
2. `compile`: the unit `torch.compile`d (fullgraph, one graph per kind of unit: every full block
   of the block schedule through one graph, a wave's kinds on the wavefront), its weights'
   gradients by autograd (a traced graph cannot hold the by-hand buffers);
3. `cuda_graphs`: the whole pass captured as two CUDA graphs, forward and backward with the
   recomputation (model/graphs.py).

The control arms recompute per layer (`layer`) and compile their residual branches (`branches`).
Which combinations a backend can run is checked here, once, against what it declares
(`Capabilities`). Nothing else reads these settings: the model's forward asks the executor, and
the engines need not know (`execution.compile` is applied the same under every engine).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch._dynamo
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from megabeta.model.attention.backend import AttentionBackend, Capabilities
from megabeta.model.config import ConfigError
from megabeta.model.execution import ExecutionConfig
from megabeta.model.graphs import Capture, CudaCapture, PassGraphs
from megabeta.model.layers import residual_branches
from megabeta.model.passes import Driver, EagerRun, PassSettings, run_pass, run_unit
from megabeta.model.plan import period


class Executor:
    """A model's execution settings, applied (module doc). `capture`: what records the CUDA
    graphs (default: `CudaCapture`; the CPU tests give `graphs.EagerCapture`)."""

    def __init__(self, execution: ExecutionConfig, *, backend: AttentionBackend,
                 device: torch.device, layers: int = 1, capture: Capture | None = None) -> None:
        self.execution, self.backend, self.device = execution, backend, device
        self.layers = layers
        caps = backend.capabilities
        if execution.compile and not caps.traced:
            raise ConfigError(f"execution.compile = true compiles beta12's recompute unit, "
                              f"which needs an attention backend that runs traced "
                              f"(cpu or triton); execution.attention = {backend.name!r} "
                              f"does not")
        graphs = execution.cuda_graphs
        if graphs and capture is None and device.type != "cuda":
            raise ConfigError(f"execution.cuda_graphs = true needs a CUDA device; this model is "
                              f"on {device}")
        if graphs and not caps.captured:
            raise ConfigError(f"execution.cuda_graphs = true captures the pass in CUDA graphs, "
                              f"which needs an attention backend that reads no device value "
                              f"on the host (triton); execution.attention = {backend.name!r} "
                              f"does")
        unit = run_unit
        if execution.compile:
            unit = torch.compile(run_unit, fullgraph=True, dynamic=False)
            self.allow_block_sizes(1)
        self.settings = PassSettings(recompute=execution.activation_checkpoint != "none",
                                     weight_gradients=_weight_gradients(execution, caps, device),
                                     unit=unit)
        self.graphs = (PassGraphs(capture or CudaCapture()) if graphs else None)
        self.branches: Callable[..., tuple[Tensor, Tensor]] = (
            torch.compile(residual_branches, dynamic=True) if execution.compile
            else residual_branches)
        """The control arms' residual branches (compiled with dynamic shapes: decoding feeds
        one token at a time)."""

    def allow_block_sizes(self, count: int) -> None:
        """Let the compiled unit hold its graphs for `count` block sizes (a curriculum's stages,
        train.block_size_schedule): one graph per kind of unit, grad mode and block size. A
        wavefront of L layers has at most about 3L + 2 kinds, more than dynamo's default limit
        of recompiles of one function."""
        limit = 2 * (3 * self.layers + 2) * count
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)

    def with_capture(self, capture: Capture) -> "Executor":
        """This executor with its CUDA graphs recorded by `capture` (tests: `EagerCapture`)."""
        return Executor(self.execution, backend=self.backend, device=self.device,
                        layers=self.layers, capture=capture)

    def period(self, layers: int, depth_window: int) -> int:
        """The plan's period (`execution.schedule`)."""
        return period(self.execution.schedule, layers, depth_window)

    def run(self, key: Any, x: Tensor, tensors: list[Tensor], documents: Tensor | None,
            make_driver: Callable[[Tensor | None], Driver]) -> Tensor:
        """A beta12 pass of the embeddings `x` and the pass's weight `tensors` (`make_driver`
        builds its driver over given documents): eagerly, or through the graphs of its `key`."""
        if self.graphs is not None:
            run = self.graphs.run(key, x, tensors, documents, make_driver)
        else:
            run = EagerRun(make_driver(documents))
        return run_pass(run, x, tensors)

    def layer(self, fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
        """A control arm's layer, recomputed in backward when checkpointing."""
        if self.settings.recompute and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)


def _weight_gradients(execution: ExecutionConfig, caps: Capabilities,
                      device: torch.device) -> str:
    """How a pass forms its weight stacks' gradients (`StackedWeight`): by autograd in a
    compiled unit; else by hand, once per pass where the kernels run on a GPU (launches and
    float32 traffic per call are what it pays for), once per call on a CPU (memory bandwidth
    is: the pass form copies every row it kept). A backend whose kernels run on a GPU
    (triton, on a CPU only interpreted) takes the GPU's form on any device, so that what the
    CPU counts of its launches is what a GPU launches."""
    if execution.compile:
        return "autograd"
    return "pass" if "cuda" in (caps.devices or {device.type}) else "call"


__all__ = ["Executor"]
