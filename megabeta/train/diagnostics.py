"""Everything that watches a run, behind the few hooks the training loop calls.

Per step, in this order (step: the 1-based number the metrics log after it):

    begin(step)                      profiler range starts; watchdog: phase `data`
    enter("forward_backward")        micro-batches in hand
    with measuring():                forward and backward (the first step's activations counted)
    gate(step, loss) -> accept       before the update: the first step's gradients measured; the
                                     stability monitor's verdict, asked by the engine (accept)
    enter("optimizer"); engine.step(..., accept)
    end(step, data_s, step_s)        profiler range ends; step and data-wait times added
    spike() -> Spike | None          the step's spike, if any (reported by `report_spike`)
    on_log(step, probe) -> records   every log interval: stragglers, memory split, per-layer
                                     gradient norms (taken in gate's accept), dials (and the
                                     finished-value collapse warning)

and `enter(phase)` around evaluation and checkpoints, `out_of_memory(step)`, `close()`.
Each part is built only when its `[profile]` / `[monitor]` settings turn it on; the others
cost a method call that returns at once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import Tensor, nn

from megabeta.train.dials import beta_dials, collapse_warning, has_dials
from megabeta.train.monitor import (
    IntervalTimes,
    Spike,
    StabilityMonitor,
    StepGate,
    describe_spike,
    find_straggler,
    gather_times,
    layer_grad_norms,
    straggler_metrics,
)
from megabeta.train.profiling import (
    ActivationCounter,
    StepProfiler,
    gradient_bytes,
    memory_split,
)
from megabeta.train.watchdog import Watchdog

if TYPE_CHECKING:
    from megabeta.config import TrainConfig

log = logging.getLogger("megabeta")

Record = tuple[str, dict[str, Any], dict[str, Tensor]]
"""(prefix, scalars, histograms) of one logged record."""


class Diagnostics:
    """The profiler, memory split, stability monitor, straggler report, hang watchdog and
    beta_1.2 dials of one rank's run."""

    def __init__(self, config: TrainConfig, run_dir: Path, *, rank: int, world_size: int,
                 device: torch.device, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> None:
        self.config = config.monitor
        self.rank, self.world_size, self.device = rank, world_size, device
        self.run_dir = run_dir
        self.model, self.optimizer = model, optimizer
        self.profiler = StepProfiler(config.profile, run_dir, rank, device)
        self.stability = StabilityMonitor(config.monitor)
        self.watchdog = (Watchdog(config.monitor.hang_seconds, run_dir, rank, world_size)
                         if config.monitor.hang_seconds > 0 else None)
        self.times = IntervalTimes()
        self.dials = config.monitor.beta_dials and has_dials(model)
        # ZeRO-3 re-partitions a module's parameters after each module call, inside
        # GatheredParameters too, and the probe's decoding path calls them piecemeal.
        self.shares = not (config.parallel.backend == "deepspeed"
                           and config.parallel.zero_stage == 3)
        if self.dials and not self.shares and rank == 0:
            log.warning("monitor.beta_dials: no attention-mass shares under DeepSpeed ZeRO-3 "
                        "(parallel.zero_stage = 3); λ, b_σ and the encodings' norms are logged")
        self.step = 0
        self.first_step: int | None = None
        self.activations: ActivationCounter | None = None
        self.grads = 0
        self._gate: StepGate | None = None
        self.log_interval = config.logging.interval
        self.layer_norms: dict[str, float] = {}

    # ---- per step -------------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        self.step = step
        if self.first_step is None:
            self.first_step = step
        self.profiler.begin(step)
        self.enter("data")

    def enter(self, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.enter(self.step, phase)

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Around the step's forward and backward: the launch's first step counts activations."""
        if self.step != self.first_step:
            yield
            return
        self.activations = ActivationCounter(self.model)
        with self.activations:
            yield

    def gate(self, step: int, loss: float) -> Callable[[float], bool]:
        if step == self.first_step:
            self.grads = gradient_bytes(self.model)
        self._gate = self.stability.gate(step, loss, self.model)
        if not (self.config.layer_grad_norms and step % self.log_interval == 0):
            return self._gate.accept
        gate = self._gate

        def accept(grad_norm: float) -> bool:
            # While the step's gradients exist (a collective under FSDP: every rank gates).
            self.layer_norms = layer_grad_norms(self.model, grad_norm)
            return gate.accept(grad_norm)

        return accept

    def end(self, step: int, data_seconds: float, step_seconds: float, *,
            last: bool = False) -> None:
        self.profiler.end(step, last=last)
        self.times.add(step_seconds, data_seconds)

    def spike(self) -> Spike | None:
        """The last gated step's spike, or None."""
        return self._gate.spike if self._gate is not None and self._gate.spike else None

    def report_spike(self, spike: Spike, positions: tuple[int, int],
                     samples: list[int]) -> None:
        if self.rank == 0:
            log.warning("%s", describe_spike(spike, self.config.spike_action, positions, samples,
                                             self.run_dir))

    # ---- every log interval ---------------------------------------------------------------------
    def on_log(self, step: int, probe: Tensor | None) -> list[Record]:
        """Collective (every rank calls it at the same steps): the records rank 0 logs."""
        self.enter("log")
        records: list[Record] = []
        if self.world_size > 1 and self.config.straggler_ratio > 0:
            per_rank = gather_times(self.times, self.device)
            found = find_straggler(per_rank, self.config.straggler_ratio)
            if found and self.rank == 0:
                log.warning("step %d: %s", step, found)
            records.append(("ranks", straggler_metrics(per_rank), {}))
        else:
            self.times.take()
        if self.activations is not None:
            split = memory_split(self.model, self.optimizer, self.grads, self.activations.bytes)
            self.activations = None
            if self.rank == 0:
                log.info("memory of step %d on rank 0: %s", step,
                         ", ".join(f"{k.removesuffix('_gib')} {v:.4g} GiB"
                                   for k, v in split.items()))
            records.append(("memory", split, {}))
        if self.layer_norms:
            records.append(("grad_norm", self.layer_norms, {}))
            self.layer_norms = {}
        if self.dials:
            start = time.perf_counter()
            scalars, histograms = beta_dials(self.model, probe if self.shares else None)
            scalars["seconds"] = time.perf_counter() - start
            records.append(("dials", scalars, histograms))
            collapsed = collapse_warning(scalars, self.config.collapse_cosine)
            if collapsed and self.rank == 0:
                log.warning("step %d: %s", step, collapsed)
        return records

    # ---- endings --------------------------------------------------------------------------------
    def out_of_memory(self, step: int) -> str:
        return self.profiler.out_of_memory(step)

    def close(self) -> None:
        self.profiler.end(self.step, last=True)  # a range the run stopped inside: still written
        self.profiler.close()
        if self.watchdog is not None:
            self.watchdog.close()


__all__ = ["Diagnostics", "Record"]
