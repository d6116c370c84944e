"""AdamW with decay/no-decay groups, and the learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from megabeta.config import OptimConfig, ScheduleConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (projections, embedding) decay; vectors (norm weights, beta_1.2's e_K/e_V/f,
    depth and self biases) do not: decaying them would pull the extras toward their zero start."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr,
                             betas=(config.beta1, config.beta2), eps=config.eps)


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


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
