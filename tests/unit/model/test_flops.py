"""Analytic FLOPs against torch's own FLOP counter and against brute-force key counts."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from megabeta.model.flops import attention_flops, dense_flops
from support.model_helpers import tiny_config, tiny_model, tokens

T = 19


@pytest.mark.parametrize("overrides", [dict(block_size=4), dict(block_size=T),
                                       dict(arch="standard"), dict(arch="looped", loops=2),
                                       dict(block_size=5, num_kv_heads=2, tie_embedding=False)])
def test_dense_flops_match_torch_flop_counter(overrides: dict) -> None:
    """Weight matmuls run as mm, or as bmm over a stack view of one layer (batch 1: the pass's
    stacked weights); attention's run batched over the batch and heads (4 here)."""
    model = tiny_model(attention="reference", **overrides)
    counted = []

    class WeightMatmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__.rstrip("_")
            if name in ("mm", "addmm") or (name in ("bmm", "baddbmm") and out.shape[0] == 1):
                a = args[-2] if name.startswith(("addmm", "baddbmm")) else args[0]
                counted.append(2 * out.numel() * a.shape[-1])
            return out

    with WeightMatmuls(), torch.no_grad():
        model(tokens(batch=1, length=T))
    config = model.config
    # What a beta12 pass of several blocks computes beyond the function's FLOPs: the layers on
    # the padding of its ragged last block, and that block's finished K/V, which nobody reads
    # (one code path for every block; flops.py counts the useful work; the head runs on the
    # real tokens only).
    wasted = 0
    c = config.block_size
    if config.arch == "beta12" and T > c:
        d, hd, kv = config.d_model, config.head_dim, config.num_kv_heads
        padding = -T % c
        per_token = config.num_layers * (2 * d * hd * (2 * config.num_heads + 2 * kv)
                                         + 2 * 3 * d * config.hidden_dim)
        wasted = padding * per_token + config.num_layers * c * 2 * d * hd * 2 * kv
    assert sum(counted) == dense_flops(config, T) + wasted
    # The same total as torch's own counter gives all matmuls minus attention's.
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(tokens(batch=1, length=T))
    assert counter.get_total_flops() > sum(counted)


def brute_force_keys(config, length: int) -> int:
    """Visible keys per (query, layer), straight from the spec §3 table."""
    c, w, total = config.block_size, config.deep_token_window, 0
    for layer in range(config.num_layers):
        for i in range(length):
            start = i // c * c
            for m in config.source_layers(layer):
                lo = max(0, start - w) if w > 0 and m > layer else 0
                total += start - lo
            total += i - start + 1
    return total


@pytest.mark.parametrize("overrides", [dict(block_size=1), dict(block_size=4),
                                       dict(block_size=4, deep_token_window=3, depth_stride=2,
                                            depth_window=3, num_layers=4)])
def test_attention_flops_count_visible_keys(overrides: dict) -> None:
    config = tiny_config(**overrides)
    per_key = 4 * config.head_dim * config.num_heads
    assert attention_flops(config, T) == per_key * brute_force_keys(config, T)


def test_one_block_costs_what_the_standard_arm_costs() -> None:
    beta = tiny_config(block_size=T)
    standard = beta.replace(arch="standard")
    assert attention_flops(beta, T) == attention_flops(standard, T)
    assert dense_flops(beta, T) == dense_flops(standard, T)
