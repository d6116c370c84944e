"""Incremental decoding (spec §4.5): prefill + steps equal one full forward."""

from __future__ import annotations

import copy

import pytest
import torch

from megabeta.infer import generate, sample_next
from support.model_helpers import tiny_model, tokens

T = 17


@pytest.mark.parametrize("arch,block,kw", [
    ("beta12", 4, {}), ("beta12", 1, {}), ("beta12", 3, dict(num_kv_heads=2, qk_norm=True)),
    ("beta12", 4, dict(deep_token_window=3, depth_stride=2)), ("beta12", 4, dict(attention="explicit")),
    ("beta12", 4, dict(attention="cpu_flash")),
    ("standard", 4, {}), ("looped", 4, dict(num_kv_heads=2)),
])
@pytest.mark.parametrize("prompt_len", [6, 8, 1], ids=["mid_block", "on_boundary", "one_token"])
def test_prefill_then_steps_equal_full_forward(arch: str, block: int, kw: dict,
                                               prompt_len: int) -> None:
    model = tiny_model(arch=arch, block_size=block, **kw)
    x = tokens(length=T)
    full = model(x)
    logits, cache = model.prefill(x[:, :prompt_len])
    steps = [logits] + [model.step(x[:, t], cache)[:, None] for t in range(prompt_len, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)
    assert cache.position == T


def test_cache_holds_one_k_and_v_per_token_and_layer() -> None:
    """Completed blocks keep finished KVs only, the current block construction KVs only."""
    model = tiny_model(block_size=4)
    _, cache = model.prefill(tokens(length=10), capacity=16)
    assert [b.length for b in cache.finished] == [8] * 3
    assert [b.length for b in cache.construction] == [2] * 3
    assert [b.length for b in cache.pending] == [2] * 3
    model.step(tokens(length=1)[:, 0], cache)
    model.step(tokens(length=1)[:, 0], cache)
    assert [b.length for b in cache.finished] == [12] * 3
    assert [b.length for b in cache.construction] == [0] * 3


def test_cache_overflow_is_a_clear_error() -> None:
    model = tiny_model(block_size=4)
    _, cache = model.prefill(tokens(length=5), capacity=6)
    model.step(tokens(length=1)[:, 0], cache)
    with pytest.raises(ValueError, match="capacity"):
        model.step(tokens(length=1)[:, 0], cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.prefill(tokens(length=5), capacity=65)


@pytest.mark.parametrize("arch", ["beta12", "standard", "looped"])
def test_greedy_generation_equals_argmax_of_full_forward(arch: str) -> None:
    model = tiny_model(arch=arch, block_size=3)
    prompt = tokens(length=5)
    out = generate(model, prompt, max_new_tokens=7, temperature=0)
    assert out.shape == (2, 12)
    assert torch.equal(out[:, :5], prompt)
    for t in range(5, 12):
        assert torch.equal(out[:, t], model(out[:, :t])[:, -1].argmax(-1))


def test_sampling_is_seeded_and_filters_apply() -> None:
    model = tiny_model(block_size=3)
    prompt = tokens(length=4)
    a = generate(model, prompt, 6, temperature=1.0, top_k=5, seed=7)
    b = generate(model, prompt, 6, temperature=1.0, top_k=5, seed=7)
    c = generate(model, prompt, 6, temperature=1.0, top_k=5, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(generate(model, prompt, 6, top_k=1, seed=3),
                       generate(model, prompt, 6, temperature=0))


def test_top_k_and_top_p_keep_the_right_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen_k = {int(sample_next(logits, 1.0, 2, None, gen)) for _ in range(200)}
    seen_p = {int(sample_next(logits, 1.0, None, 0.7, gen)) for _ in range(200)}
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}  # 0.5 < 0.7 needs the second token, 0.8 >= 0.7 stops there
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, 1.0, None, 1.5, gen)


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
