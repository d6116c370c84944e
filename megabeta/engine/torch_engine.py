"""`TorchEngine`: single process, DDP or FSDP2 with torch's AdamW (engine/base.py's contract).

Parallelisms are applied by parallel/wrap.py: DDP or FSDP2 (the model's executor compiled or
captured what `[execution]` asks when the model was placed on its device).
Mixed precision is autocast (bf16) for the forward; parameters and optimizer state stay fp32
(FSDP2 may gather bf16 parameters, `parallel.fsdp_param_dtype`). Checkpoints are DCP: sharded,
and reshardable to another world size.
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from megabeta.storage.safe_load import dcp_reader
from megabeta.config import TrainConfig
from megabeta.engine.base import StepResult, document_kwargs
from megabeta.engine.optim import build_optimizer, set_lr
from megabeta.parallel.wrap import apply_ddp, apply_fsdp


class TorchEngine:
    """single / ddp / fsdp (`parallel.backend`)."""

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device) -> None:
        self.name = config.parallel.backend
        self.device = device
        self.model = model.to(device)
        self.module: nn.Module = self.model
        if self.name == "ddp":
            self.module = apply_ddp(self.model, device)
        elif self.name == "fsdp":
            apply_fsdp(self.model, config.parallel.fsdp_param_dtype,
                       config.parallel.fsdp_reduce_dtype)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.grad_clip = config.optim.grad_clip
        self.bf16 = config.train.precision == "bf16"

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients only on the last micro-batch of a step."""
        if self.name == "ddp" and not last:
            return self.module.no_sync()
        if self.name == "fsdp":
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def forward_backward(self, inputs: Tensor, targets: Tensor, *, last: bool,
                         scale: float, documents: Tensor | None = None) -> Tensor:
        with self._sync(last):
            with self._autocast():
                loss = self.module(inputs, targets, **document_kwargs(documents))
            (loss * scale).backward()
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, inputs: Tensor, targets: Tensor,
                  documents: Tensor | None = None) -> Tensor:
        with self._autocast():
            return self.module(inputs, targets, **document_kwargs(documents)).detach()

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def step(self, loss_finite: bool,
             accept: Callable[[float], bool] | None = None) -> StepResult:
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            norm = norm.full_tensor()
        norm = float(norm)
        applied = loss_finite and math.isfinite(norm) and (accept is None or accept(norm))
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(norm, applied)

    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, path: Path, *, async_save: bool = False) -> Future | None:
        # sync_files: each rank fsyncs the shards it wrote (checkpoint/manager.py's commit order).
        state, writer = self._state(), dcp.FileSystemWriter(str(path), sync_files=True)
        if async_save:
            return dcp.async_save(state, storage_writer=writer)
        dcp.save(state, storage_writer=writer)
        return None

    def load(self, path: Path) -> None:
        state = self._state()
        dcp.load(state, **dcp_reader(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
