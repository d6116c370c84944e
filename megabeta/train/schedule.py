"""Learning-rate schedules: the learning rate of each optimizer step."""

from __future__ import annotations

import math

from megabeta.config import OptimConfig, ScheduleConfig


def schedule_horizon(total_steps: int, schedule: ScheduleConfig) -> int:
    """The steps the schedule decays over: `schedule.total_steps`, or `total_steps` (train.steps)
    when that is 0."""
    return schedule.total_steps or total_steps


def lr_at(step: int, total_steps: int, optim: OptimConfig, schedule: ScheduleConfig) -> float:
    """Learning rate of optimizer step `step` (0-based) of a run of `total_steps` (train.steps).

    Linear warm-up to `optim.lr`, then `cosine` or `linear` decay to `min_lr_ratio · lr`, `wsd`
    (stable at `lr`, then linear decay over the last `decay_fraction` of the run) or `constant`.
    The decay runs over `schedule_horizon(total_steps, schedule)` steps; past it the rate stays
    at the floor.
    """
    total_steps = schedule_horizon(total_steps, schedule)
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


def horizon_change_warning(step: int, saved_horizon: int, total_steps: int, optim: OptimConfig,
                           schedule: ScheduleConfig) -> str | None:
    """What to warn about when a run resumed at `step` decays its learning rate over another
    horizon than the checkpoint was trained with (`saved_horizon`; 0 = not recorded): both
    schedules' rate at that step and how to keep the original. None when nothing changes."""
    horizon = schedule_horizon(total_steps, schedule)
    if not saved_horizon or saved_horizon == horizon or schedule.kind == "constant":
        return None
    kept = ScheduleConfig(**{**vars(schedule), "total_steps": saved_horizon})
    was, now = lr_at(step, saved_horizon, optim, kept), lr_at(step, total_steps, optim, schedule)
    source = (f"schedule.total_steps = {schedule.total_steps}" if schedule.total_steps
              else f"train.steps = {total_steps}")
    return (f"the learning-rate schedule changes on resume: the checkpoint was trained with a "
            f"{schedule.kind} schedule over {saved_horizon} steps, this run decays over {horizon} "
            f"({source}); at the resumed step {step} the lr is {now:.3g} now, {was:.3g} on the "
            f"original schedule. To keep the original schedule (and stay at its final lr past "
            f"step {saved_horizon}), pass --schedule.total_steps={saved_horizon}")
