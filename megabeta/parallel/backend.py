"""Training backends: one interface over single-process, DDP, FSDP2 and DeepSpeed training.

The loop calls `forward_backward` once per micro-batch and `step` once per optimizer step;
checkpoints go through `save`/`load`. `TorchBackend` covers single, DDP and FSDP2 (optimizer,
clipping and mixed precision are ours, checkpoints are DCP); `DeepSpeedBackend` hands all of it to
a DeepSpeed engine.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from megabeta.config import TrainConfig
from megabeta.parallel.wrap import apply_compile, apply_ddp, apply_fsdp
from megabeta.train.optim import build_optimizer, param_groups, set_lr


class TorchBackend:
    """single / ddp / fsdp with torch's AdamW; checkpoints are DCP (sharded, reshardable)."""

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device) -> None:
        self.kind = config.parallel.backend
        self.device = device
        self.model = model.to(device)
        if config.parallel.compile:
            apply_compile(self.model)
        self.module: nn.Module = self.model
        if self.kind == "ddp":
            self.module = apply_ddp(self.model, device)
        elif self.kind == "fsdp":
            apply_fsdp(self.model, config.parallel.fsdp_param_dtype,
                       config.parallel.fsdp_reduce_dtype)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.grad_clip = config.optim.grad_clip
        self.bf16 = config.train.precision == "bf16"

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients only on the last micro-batch of a step."""
        if self.kind == "ddp" and not last:
            return self.module.no_sync()
        if self.kind == "fsdp":
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def forward_backward(self, inputs: Tensor, targets: Tensor, last: bool, scale: float) -> Tensor:
        with self._sync(last):
            with self.autocast():
                loss = self.module(inputs, targets)
            (loss * scale).backward()
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, inputs: Tensor, targets: Tensor) -> Tensor:
        with self.autocast():
            return self.module(inputs, targets).detach()

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def step(self, loss_finite: bool) -> tuple[float, bool]:
        """Clip and apply the accumulated gradients; skip the update when anything is non-finite.

        Returns (global gradient norm before clipping, whether the update was applied).
        """
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            norm = norm.full_tensor()
        norm = float(norm)
        applied = loss_finite and math.isfinite(norm)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, applied

    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, path: Path, async_save: bool = False):
        """Write model and optimizer shards into `path` (collective). Returns a future if async."""
        state = self._state()
        if async_save:
            return dcp.async_save(state, checkpoint_id=str(path))
        dcp.save(state, checkpoint_id=str(path))
        return None

    def load(self, path: Path) -> None:
        state = self._state()
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


class DeepSpeedBackend:
    """DeepSpeed ZeRO 1/2/3: the engine owns accumulation, clipping, bf16 and the optimizer.

    DeepSpeed skips an update whose gradient norm is not finite by itself (its overflow check);
    `step` reports that as not applied.
    """

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device,
                 grad_accumulation: int, load_universal: bool = False) -> None:
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # skips DeepSpeed's probing warning
        import deepspeed

        self.device = device
        self.model = model.to(device)
        p = config.parallel
        zero: dict = {"stage": p.zero_stage}
        if p.zero_stage == 3:
            # The block loop reuses every layer T/c times per step: keep gathered parameters
            # alive for the whole step so each is fetched once (the first step records the trace).
            zero.update(stage3_max_reuse_distance=1e12, stage3_prefetch_bucket_size=1e9,
                        stage3_max_live_parameters=1e12, stage3_param_persistence_threshold=0)
        ds_config = {
            "train_micro_batch_size_per_gpu": config.train.micro_batch,
            "gradient_accumulation_steps": grad_accumulation,
            "gradient_clipping": config.optim.grad_clip,
            "bf16": {"enabled": config.train.precision == "bf16"},
            "zero_optimization": zero,
            "steps_per_print": 2**62,
            "wall_clock_breakdown": False,
            # Resuming at another world size goes through DeepSpeed's universal checkpoint.
            "checkpoint": {"load_universal": load_universal},
        }
        self.load_universal = load_universal
        groups = param_groups(self.model, config.optim.weight_decay)
        optimizer = None
        if p.deepspeed_optimizer == "deepspeed":
            ds_config["optimizer"] = {"type": "AdamW", "params": {
                "lr": config.optim.lr, "betas": [config.optim.beta1, config.optim.beta2],
                "eps": config.optim.eps, "weight_decay": config.optim.weight_decay}}
        else:
            optimizer = build_optimizer(self.model, config.optim)
            groups = None
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.model, optimizer=optimizer, model_parameters=groups, config=ds_config)
        self.module = self.engine

    def forward_backward(self, inputs: Tensor, targets: Tensor, last: bool, scale: float) -> Tensor:
        loss = self.engine(inputs, targets)
        self.engine.backward(loss)  # the engine scales by 1/accumulation itself
        self.engine.step()          # applies the update at the accumulation boundary only
        return loss.detach().float()

    @torch.no_grad()
    def eval_loss(self, inputs: Tensor, targets: Tensor) -> Tensor:
        return self.engine(inputs, targets).detach().float()

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def step(self, loss_finite: bool) -> tuple[float, bool]:
        norm = self.engine.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        return norm, math.isfinite(norm)

    def save(self, path: Path, async_save: bool = False):
        self.engine.save_checkpoint(str(path), tag="engine")
        return None

    def load(self, path: Path) -> None:
        tag = "engine"
        if self.load_universal:
            tag = "universal"
            if self.engine.global_rank == 0 and not (path / tag).is_dir():
                _to_universal(path / "engine", path / tag)
            torch.distributed.barrier()
        load_path, _ = self.engine.load_checkpoint(str(path), tag=tag)
        if load_path is None:
            raise FileNotFoundError(f"{path}: no DeepSpeed engine checkpoint (tag {tag!r}) inside")


def _to_universal(engine_dir: Path, out: Path) -> None:
    """DeepSpeed's own conversion (ds_to_universal), written under a temporary name."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           str(engine_dir), "--output_folder", str(tmp), "--num_extract_workers", "1",
           "--num_merge_workers", "1", "--inject_missing_state"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed on {engine_dir}: {done.stderr[-2000:]}")
    os.replace(tmp, out)
