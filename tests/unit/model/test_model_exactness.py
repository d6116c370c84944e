"""The block loop on every attention backend against the naive spec reference (spec §4.3)."""

from __future__ import annotations

import pytest
import torch

from support.model_helpers import ATTENTION, tiny_model, tokens
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
@pytest.mark.parametrize("attention", ATTENTION)
def test_block_loop_matches_naive_reference(case: str, attention: str) -> None:
    model = tiny_model(attention=attention, **CASES[case])
    assert model.attention_backend.name == attention
    x = tokens(length=T)
    expected = reference_logits(model.state_dict(), model.config, x)
    got = model(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["c3_k2", "gqa", "deep_token_window"])
def test_low_precision_fused_kernel_matches_reference(case: str, dtype: torch.dtype,
                                                      atol: float) -> None:
    """float64 checks exactness; float32 and bfloat16 run the same kernels at their precision
    (the log-sum-exp merge of the history groups happens in float32)."""
    model = tiny_model(**CASES[case])
    x = tokens(length=T)
    expected = reference_logits(model.state_dict(), model.config, x)
    got = model.to(dtype)(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("checkpoint", ["none", "block"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_backend_gradients_agree_with_explicit(case: str, checkpoint: str) -> None:
    """The fast backends read the history from buffers whose gradients they route back by hand
    (model/history.py), with the learnable biases as lse shifts; their gradients must equal
    those of the literal matmul-softmax over concatenated pieces (explicit)."""
    x, y = tokens(length=T), tokens(length=T, seed=2)
    grads = []
    assert ATTENTION[0] == "explicit"
    for attention in ATTENTION:
        model = tiny_model(attention=attention, activation_checkpoint=checkpoint, **CASES[case])
        model(x, y).backward()
        # No grad (a θ whose layer reads no deeper group) counts as a zero grad.
        grads.append({n: torch.zeros_like(p) if p.grad is None else p.grad
                      for n, p in model.named_parameters()})
    assert all(grads[0][n].abs().sum() > 0 for n in grads[0]
               if n.endswith(("self_bias", "e_k", "e_v")) and CASES[case].get("block_size") < T)
    for other in grads[1:]:
        for name in grads[0]:
            torch.testing.assert_close(other[name], grads[0][name], rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fused_gradient_matches_finite_differences(dropout: float) -> None:
    """An independent check of the hand-routed history gradients: the directional derivative of
    the loss equals the central difference; with attention dropout the backward must replay the
    forward's dropout masks (same seed, same masks)."""
    model = tiny_model(block_size=4, dropout=dropout, activation_checkpoint="block")
    x, y = tokens(length=T), tokens(length=T, seed=2)

    def loss() -> torch.Tensor:
        torch.manual_seed(7)
        return model(x, y)

    loss().backward()
    gen = torch.Generator().manual_seed(3)
    params = list(model.parameters())
    direction = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    analytic = sum((p.grad * d).sum() for p, d in zip(params, direction))
    eps = 1e-6
    with torch.no_grad():
        values = []
        for sign in (1, -1):
            for p, d in zip(params, direction):
                p.add_(sign * eps * d)
            values.append(loss())
            for p, d in zip(params, direction):
                p.sub_(sign * eps * d)
    numeric = (values[0] - values[1]) / (2 * eps)
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-8)


def test_buffered_history_checks_its_ordering() -> None:
    """A finished KV's gradient may only be handed out once every reader created after its
    publish ran backward, and each layer's blocks publish in order: each violation is an
    error, not a silent wrong gradient."""
    from megabeta.model.history import BufferedHistory, block_cells

    history = BufferedHistory([[0, 1], [1]], 0, 12, dtype=torch.float64)
    fin = [torch.randn(1, 1, 4, 8, dtype=torch.float64) for _ in range(2)]
    history.publish(block_cells(0, 2), fin, fin)
    with pytest.raises(RuntimeError, match="out of order"):
        history.publish([(8, 0)], fin[:1], fin[:1])
    history.publish([(4, 0)], fin[:1], fin[:1])  # one layer at a time, as a wave publishes
    history.publish([(4, 1)], fin[:1], fin[:1])
    views = [history.view(4), history.view(8)]
    for view in views:
        for layer in (0, 1):
            view.key_set(layer, fin[0], fin[0])
    views[0].done_reading()
    views[0].done_reading()
    views[1].done_reading()  # the view at 8: one of its two layers has not run backward
    with pytest.raises(RuntimeError, match="ordering"):
        history.release(0, 4, [torch.float64] * 4)
    views[1].done_reading()
    assert history.release(0, 4, [torch.float64] * 4) == [None] * 4  # no reader gradient yet: nothing to hand out
