"""Is the run about to diverge, and is one rank slowing the others: the stability monitor
(loss and gradient-norm spikes) and the straggler report.

Stability: each step's loss and gradient norm are compared with the running window of the last
`monitor.spike_window` accepted steps (z-score: (x - mean) / std, upward only). A spike is logged
with the step, its data position (stream positions and dataset sample indices, for
`megabeta-data inspect`) and the per-layer gradient norms of that step; `monitor.spike_action`
then applies the step (`log`), skips its update (`skip`, counted like a non-finite step), or
skips it and stops the run with a checkpoint of the last good state (`stop`). The engine asks
`StepGate.accept(norm)` between computing the norm and updating, so the per-layer norms are those
of the gradients the step had. Spikes do not enter the window: a spike does not widen the
threshold for the next one.

Stragglers: every log interval each rank's mean step time and data-wait time over the interval
are gathered (one all-gather of two floats); rank 0 names the slowest rank when its time exceeds
`monitor.straggler_ratio` times the median. In synchronous training the ranks' step times
equalise at the collectives, so a slow rank shows as the one whose data wait or step time stands
out; the hang watchdog (watchdog.py) covers a rank that stops altogether.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from megabeta.config import MonitorConfig

log = logging.getLogger("megabeta")


class RunningWindow:
    """The last `size` values; the z-score of a new one against them."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)

    def zscore(self, value: float, min_values: int) -> float | None:
        """(value - mean) / std of the window, None until it holds `min_values`; a flat window
        (std 0) scores any rise as infinite."""
        if len(self.values) < min_values or not math.isfinite(value):
            return None
        mean = statistics.fmean(self.values)
        std = statistics.pstdev(self.values, mean)
        if std == 0:
            return 0.0 if value <= mean else math.inf
        return (value - mean) / std

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.values.append(value)


@dataclass
class Spike:
    """One step's verdict: which signals spiked, and what was recorded about it."""

    step: int
    reasons: list[str] = field(default_factory=list)
    layer_norms: dict[str, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.reasons)


def layer_grad_norms(model: nn.Module, total: float) -> dict[str, float]:
    """Gradient norm per layer (`layers.<i>`) and for the rest (embeddings, final norm, head)
    before clipping, whose global norm was `total`: the gradients may have been clipped since,
    which scales every one by the same factor, undone here. FSDP2's sharded gradients are
    reduced across ranks (every rank calls this on the same step)."""
    squares: dict[str, torch.Tensor] = {}
    sharded = False
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad
        if hasattr(grad, "to_local"):
            grad, sharded = grad.to_local(), True
        match = re.match(r"(layers\.\d+)\.", name)
        key = match.group(1) if match else "other"
        value = grad.detach().double().pow(2).sum()
        squares[key] = squares[key] + value if key in squares else value
    if not squares:
        return {}
    names = sorted(squares, key=lambda k: (k == "other", int(k.split(".")[1]) if "." in k else 0))
    stacked = torch.stack([squares[k] for k in names])
    if sharded and dist.is_initialized():
        dist.all_reduce(stacked)
    norms = stacked.sqrt()
    scale = total / float(norms.norm()) if float(norms.norm()) > 0 else 1.0
    return {k: float(v) * scale for k, v in zip(names, norms.tolist())}


class StabilityMonitor:
    """Loss and gradient-norm spike detection against running windows (`[monitor]`)."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.enabled = config.spike_window > 0
        self.loss = RunningWindow(config.spike_window)
        self.grad_norm = RunningWindow(config.spike_window)

    def gate(self, step: int, loss: float, model: nn.Module) -> "StepGate":
        return StepGate(self, Spike(step), loss, model)

    def _judge(self, spike: Spike, loss: float, norm: float, model: nn.Module) -> bool:
        """Record whether this step spiked; True when its update may be applied."""
        c = self.config
        for name, window, value, limit in (("loss", self.loss, loss, c.loss_zscore),
                                           ("grad_norm", self.grad_norm, norm,
                                            c.grad_norm_zscore)):
            z = window.zscore(value, c.spike_min_steps)
            if z is not None and z > limit:
                spike.reasons.append(f"{name} {value:.4g} is {z:.1f} std above the last "
                                     f"{len(window.values)} steps' mean "
                                     f"{statistics.fmean(window.values):.4g} "
                                     f"(monitor.{name}_zscore = {limit})")
        if spike:
            spike.layer_norms = layer_grad_norms(model, norm)
            return c.spike_action == "log"
        self.loss.add(loss)
        self.grad_norm.add(norm)
        return True


class StepGate:
    """What the engine asks before applying a step's update (`Engine.step(accept=...)`)."""

    def __init__(self, monitor: StabilityMonitor, spike: Spike, loss: float,
                 model: nn.Module) -> None:
        self.monitor, self.spike, self.loss, self.model = monitor, spike, loss, model

    def accept(self, grad_norm: float) -> bool:
        """Called with the step's global gradient norm while its gradients still exist."""
        if not self.monitor.enabled or not (math.isfinite(grad_norm)
                                            and math.isfinite(self.loss)):
            return True  # non-finite steps are the engine's to skip; nothing to judge
        return self.monitor._judge(self.spike, self.loss, grad_norm, self.model)


def describe_spike(spike: Spike, action: str, positions: tuple[int, int],
                   samples: list[int], run_dir: Path) -> str:
    """The warning a spike gets: step, why, data position (with the command that decodes its
    samples), per-layer gradient norms."""
    shown = ", ".join(map(str, samples[:16])) + (", ..." if len(samples) > 16 else "")
    norms = ", ".join(f"{k} {v:.4g}" for k, v in spike.layer_norms.items())
    verdict = {"log": "applied", "skip": "update skipped", "stop": "update skipped, stopping"}
    return (f"spike at step {spike.step} ({verdict[action]}): {'; '.join(spike.reasons)} | data: "
            f"stream positions [{positions[0]}, {positions[1]}), dataset samples [{shown}] "
            f"(megabeta-data inspect --run {run_dir} --step {spike.step}) | "
            f"grad norms per layer: {norms}")


# ---- stragglers --------------------------------------------------------------------------------
class IntervalTimes:
    """This rank's step and data-wait seconds summed since the last log."""

    def __init__(self) -> None:
        self.step = self.data = 0.0
        self.steps = 0

    def add(self, step_seconds: float, data_seconds: float) -> None:
        self.step += step_seconds
        self.data += data_seconds
        self.steps += 1

    def take(self) -> tuple[float, float]:
        """Mean step and data-wait seconds of the interval; restarts it."""
        n = max(self.steps, 1)
        means = (self.step / n, self.data / n)
        self.__init__()
        return means


def gather_times(times: IntervalTimes, device: torch.device) -> list[tuple[float, float]]:
    """Every rank's (step, data-wait) means of the interval (collective)."""
    mine = torch.tensor(times.take(), dtype=torch.float64, device=device)
    if not dist.is_initialized():
        return [tuple(mine.tolist())]
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [tuple(t.tolist()) for t in every]


STRAGGLER_FLOOR_S = 0.01
"""Differences under this many seconds are noise, whatever their ratio (a data wait of 0.3 ms
against 0.1 ms is 3x the median and means nothing)."""


def find_straggler(per_rank: list[tuple[float, float]], ratio: float) -> str | None:
    """A sentence naming the rank whose step or data-wait time exceeds `ratio` x the median
    (the larger excess wins), or None."""
    worst: tuple[float, str] | None = None
    for index, what in ((0, "step time"), (1, "data wait")):
        values = [t[index] for t in per_rank]
        median = statistics.median(values)
        rank = max(range(len(values)), key=values.__getitem__)
        if values[rank] <= ratio * median or values[rank] - median < STRAGGLER_FLOOR_S:
            continue
        excess = values[rank] / median if median > 0 else math.inf
        if worst is None or excess > worst[0]:
            worst = (excess, f"straggler: rank {rank} {what} {values[rank]:.3g} s per step, "
                             f"{excess:.3g}x the median {median:.3g} s over {len(values)} ranks "
                             f"(monitor.straggler_ratio = {ratio})")
    return None if worst is None else worst[1]


def straggler_metrics(per_rank: list[tuple[float, float]]) -> dict[str, Any]:
    """The logged figures: slowest rank's step and data-wait seconds and the medians."""
    steps, waits = [t[0] for t in per_rank], [t[1] for t in per_rank]
    return {"step_s_max": max(steps), "step_s_median": statistics.median(steps),
            "step_s_slowest_rank": max(range(len(steps)), key=steps.__getitem__),
            "data_s_max": max(waits), "data_s_median": statistics.median(waits)}


__all__ = ["IntervalTimes", "RunningWindow", "Spike", "StabilityMonitor", "StepGate",
           "describe_spike", "find_straggler", "gather_times", "layer_grad_norms",
           "straggler_metrics"]
