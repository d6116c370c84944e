"""AdamW with decay/no-decay parameter groups, built the same way for every engine."""

from __future__ import annotations

import torch
from torch import nn

from megabeta.config import OptimConfig


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


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate (the schedule is the trainer's, megabeta/train/schedule.py)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
