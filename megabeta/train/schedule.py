"""Learning-rate schedules: the learning rate of each optimizer step."""

from __future__ import annotations

import math

from megabeta.config import OptimConfig, ScheduleConfig


def lr_at(step: int, total_steps: int, optim: OptimConfig, schedule: ScheduleConfig) -> float:
    """Learning rate of optimizer step `step` (0-based) of `total_steps`.

    Linear warm-up to `optim.lr`, then `cosine` or `linear` decay to `min_lr_ratio · lr`, `wsd`
    (stable at `lr`, then linear decay over the last `decay_fraction` of the run) or `constant`.
    """
    peak, floor = optim.lr, optim.lr * schedule.min_lr_ratio
    warmup = schedule.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule.kind == "constant":
        return peak
    if schedule.kind == "wsd":
        decay_steps = max(1, round(total_steps * schedule.decay_fraction))
        decay_start = max(warmup, total_steps - decay_steps)
        if step < decay_start:
            return peak
        progress = min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
        return peak - (peak - floor) * progress
    progress = min(1.0, (step - warmup + 1) / max(1, total_steps - warmup))
    if schedule.kind == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
