"""The fast block loop (both attention paths) against the naive spec reference (spec §4.3)."""

from __future__ import annotations

import pytest
import torch

from model_helpers import tiny_model, tokens
from reference_beta12 import reference_logits

T = 19  # not a multiple of 3 or 8: the last block is ragged

CASES = {
    "c1_k2": dict(block_size=1),
    "c3_k0": dict(block_size=3, depth_window=0),
    "c3_k1": dict(block_size=3, depth_window=1),
    "c3_k2": dict(block_size=3, depth_window=2),
    "c3_kL": dict(block_size=3, depth_window=3),
    "c8_k2": dict(block_size=8),
    "cT": dict(block_size=T),
    "c_over_T": dict(block_size=32),
    "stride2": dict(block_size=3, depth_window=3, num_layers=4, depth_stride=2),
    "deep_token_window": dict(block_size=3, depth_window=2, deep_token_window=4),
    "window_within_block": dict(block_size=8, deep_token_window=2),
    "qk_norm": dict(block_size=4, qk_norm=True),
    "gqa": dict(block_size=4, num_kv_heads=2),
    "mqa_untied": dict(block_size=5, num_kv_heads=1, tie_embedding=False),
    "no_extras": dict(block_size=3, depth_bias=False, layer_enc=False, self_slot=False),
    "only_self": dict(block_size=3, depth_bias=False, layer_enc=False),
    "only_depth": dict(block_size=3, self_slot=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("use_sdpa", [True, False], ids=["sdpa", "explicit"])
def test_block_loop_matches_naive_reference(case: str, use_sdpa: bool) -> None:
    model = tiny_model(use_sdpa=use_sdpa, **CASES[case])
    x = tokens(length=T)
    expected = reference_logits(model.state_dict(), model.config, x)
    got = model(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)


@pytest.mark.parametrize("case", ["c3_k2", "gqa", "deep_token_window"])
def test_fp32_fused_kernel_matches_reference(case: str) -> None:
    """float64 runs SDPA's math kernel; float32 exercises the fused (flash) CPU kernel."""
    model = tiny_model(**CASES[case])
    x = tokens(length=T)
    expected = reference_logits(model.state_dict(), model.config, x)
    got = model.float()(x)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-4)


@pytest.mark.parametrize("case", ["c3_k2", "gqa", "stride2", "qk_norm"])
def test_fused_and_explicit_gradients_agree(case: str) -> None:
    """The fused path routes the learnable biases through extra head dimensions; its gradients
    must equal those of the literal matmul-softmax path."""
    x, y = tokens(length=T), tokens(length=T, seed=2)
    grads = []
    for use_sdpa in (True, False):
        model = tiny_model(use_sdpa=use_sdpa, **CASES[case])
        model(x, y).backward()
        # No grad (a θ whose layer reads no deeper group) counts as a zero grad.
        grads.append({n: torch.zeros_like(p) if p.grad is None else p.grad
                      for n, p in model.named_parameters()})
    assert all(grads[1][n].abs().sum() > 0 for n in grads[1] if n.endswith("self_bias"))
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=1e-10, msg=name)
