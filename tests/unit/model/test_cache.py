"""Incremental decoding (spec §4.5, model/cache.py): prefill + steps equal one full forward on
every backend, the cache in the history's form."""

from __future__ import annotations

import copy

import pytest
import torch

from support.model_helpers import ATTENTION, tiny_model, tokens

T = 17

ARMS = [
    ("beta12", 4, {}), ("beta12", 1, {}), ("beta12", 3, dict(num_kv_heads=2, qk_norm=True)),
    ("beta12", 4, dict(deep_token_window=3, depth_stride=2)),
    ("standard", 4, {}), ("looped", 4, dict(num_kv_heads=2)),
]
TRITON = pytest.param("triton", marks=pytest.mark.slow)  # under the interpreter


@pytest.mark.parametrize("attention", [*ATTENTION, TRITON])
@pytest.mark.parametrize("arch,block,kw", ARMS)
@pytest.mark.parametrize("prompt_len", [6, 8, 1], ids=["mid_block", "on_boundary", "one_token"])
def test_prefill_then_steps_equal_full_forward(arch: str, block: int, kw: dict,
                                               prompt_len: int, attention: str) -> None:
    triton = attention == "triton"
    model = tiny_model(arch=arch, block_size=block, attention=attention,
                       elementwise_kernels="triton" if triton else "auto", **kw)
    if triton:
        model = model.float()
    x = tokens(length=T)
    full = model(x)
    logits, cache = model.prefill(x[:, :prompt_len])
    steps = [logits] + [model.step(x[:, t], cache)[:, None] for t in range(prompt_len, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0,
                               atol=1e-5 if triton else 1e-10)
    assert cache.position == T


def test_cache_holds_one_k_and_v_per_token_and_layer() -> None:
    """Every layer's finished K/V over the capacity (the current block's written as they come,
    read once the block completes), and one block of construction K/V."""
    model = tiny_model(block_size=4)
    _, cache = model.prefill(tokens(length=10), capacity=16)
    layers, batch, heads, width = 3, 2, 4, 8
    assert cache.history.keys.shape == (layers, batch, heads, 16, width)
    assert cache.construction_k.shape == (layers, batch, heads, 4, width)
    assert cache.memory_bytes() == 2 * 8 * layers * batch * heads * width * (16 + 4)
    before = cache.history.keys[:, :, :, :10].clone()
    model.step(tokens(length=1)[:, 0], cache)
    torch.testing.assert_close(cache.history.keys[:, :, :, :10], before, rtol=0, atol=0)


def test_cache_overflow_is_a_clear_error() -> None:
    model = tiny_model(block_size=4)
    _, cache = model.prefill(tokens(length=5), capacity=6)
    model.step(tokens(length=1)[:, 0], cache)
    with pytest.raises(ValueError, match="capacity"):
        model.step(tokens(length=1)[:, 0], cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.prefill(tokens(length=5), capacity=65)


@pytest.mark.parametrize("arch", ["beta12", "standard"])
def test_decoding_builds_fused_weights_once_until_they_change(arch: str, monkeypatch) -> None:
    """Steps reuse the cache's fused weights; an in-place weight update (an optimizer step)
    makes the next step rebuild them: it equals a step whose cache is forced to rebuild."""
    model = tiny_model(arch=arch, block_size=4)
    builds = []
    original = type(model).decode_weights

    def counted(self, cache, build):
        return original(self, cache, lambda: builds.append(1) or build())

    monkeypatch.setattr(type(model), "decode_weights", counted)
    x = tokens(length=9)
    _, cache = model.prefill(x[:, :6])
    for t in range(6, 8):
        model.step(x[:, t], cache)
    assert len(builds) == 1
    with torch.no_grad():
        model.layers[0].attention.wq.weight.mul_(1.5)
    rebuilt = copy.deepcopy(cache)
    rebuilt.weights = None
    stepped = model.step(x[:, 8], cache)
    assert len(builds) == 2
    torch.testing.assert_close(stepped, model.step(x[:, 8], rebuilt), rtol=0, atol=0)
