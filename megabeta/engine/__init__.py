"""Engines: how one rank's model is trained (engine/base.py declares the contract)."""

from __future__ import annotations

import torch
from torch import nn

from megabeta.config import TrainConfig
from megabeta.engine.base import Engine, StepResult


def build_engine(model: nn.Module, config: TrainConfig, device: torch.device, *,
                 grad_accumulation: int, resharding: bool = False) -> Engine:
    """The engine `config.parallel.backend` names, around `model` on `device`. `resharding`:
    the run resumes a checkpoint written at another world size."""
    if config.parallel.backend == "deepspeed":
        from megabeta.engine.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(model, config, device, grad_accumulation=grad_accumulation,
                               load_universal=resharding)
    from megabeta.engine.torch_engine import TorchEngine

    return TorchEngine(model, config, device)


__all__ = ["Engine", "StepResult", "build_engine"]
