"""Parallelisms applied to a plain model: DDP or FSDP2.

The model code applies none of them; each arm declares only its plan (`DecoderLM.parallel_plan`:
its FSDP units), so nothing here branches on a model class. (Checkpointing, compile and CUDA
graphs are the model's executor's, applied when it is placed on its device, the same under
every engine: megabeta/model/executor.py.) One
fact about beta_1.2 shapes the FSDP2 plan: its pass reads every layer's weights through stacks
built once per pass (model/pass_weights.py) and never calls `layer.forward`, so per-layer FSDP
units would otherwise never be gathered by their own hooks. Instead every layer unit is unsharded ONCE, by a
forward pre-hook on the root, and kept unsharded until its gradients are reduce-scattered after
backward (`reshard_after_forward=False`): one all-gather per layer in forward, none in backward,
one reduce-scatter per step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def apply_ddp(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    # Some parameters get no gradient in some configurations (e_K/e_V when c >= T), hence
    # find_unused_parameters.
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)


def apply_fsdp(model: nn.Module, param_dtype: str = "fp32", reduce_dtype: str = "fp32") -> nn.Module:
    """FSDP2: one unit per unit of the arm's plan (a layer) and one at the root, each gathered
    once per step (module doc)."""
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype],
                                  reduce_dtype=DTYPES[reduce_dtype])
    units = model.parallel_plan().fsdp_units
    for unit in units:
        fully_shard(unit, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)

    def unshard_layers(module: nn.Module, args: tuple) -> None:
        handles = [unit.unshard(async_op=True) for unit in units]
        for handle in handles:
            if handle is not None:
                handle.wait()

    model.register_forward_pre_hook(unshard_layers)
    return model
