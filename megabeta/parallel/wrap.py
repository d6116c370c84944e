"""Parallelisms applied to a plain model, in a fixed order: compile, then DDP or FSDP2.

The model code knows nothing of them. One fact about beta_1.2 shapes the FSDP2 plan: the block
loop calls every layer's submodules T/c times per step and never calls `layer.forward`, so
per-layer FSDP units would otherwise gather their parameters on every call (or not at all).
Instead every layer unit is unsharded ONCE, by a forward pre-hook on the root, and kept
unsharded until its gradients are reduce-scattered after backward (`reshard_after_forward=False`):
one all-gather per layer in forward, none in backward, one reduce-scatter per step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from megabeta.model.beta12 import Beta12Transformer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def apply_compile(model: nn.Module) -> None:
    """torch.compile the model's repeated work in place (state-dict names are kept).

    beta12: the block step, ONE graph for every full block of a sequence, forward, recompute
    and backward (`Beta12Transformer.compile_block_step`; the history's publish and the loss
    stay eager). The other arms: every layer's residual branches, `attention_delta` (output
    projection, dropout) and `mlp_delta` (SwiGLU, dropout), with dynamic shapes (decoding feeds
    one token at a time); their fused input projections and attention stay eager.
    """
    if isinstance(model, Beta12Transformer):
        model.compile_block_step()
        return
    for layer in model.layers:
        layer.attention_delta = torch.compile(layer.attention_delta, dynamic=True)
        layer.mlp_delta = torch.compile(layer.mlp_delta, dynamic=True)


def apply_ddp(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    # Some parameters get no gradient in some configurations (e_K/e_V when c >= T, θ of the top
    # layer on the explicit path), hence find_unused_parameters.
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)


def apply_fsdp(model: nn.Module, param_dtype: str = "fp32", reduce_dtype: str = "fp32") -> nn.Module:
    """FSDP2: one unit per layer and one at the root, each gathered once per step (module doc)."""
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype],
                                  reduce_dtype=DTYPES[reduce_dtype])
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)

    def unshard_layers(module: nn.Module, args: tuple) -> None:
        handles = [layer.unshard(async_op=True) for layer in module.layers]
        for handle in handles:
            if handle is not None:
                handle.wait()

    model.register_forward_pre_hook(unshard_layers)
    return model
