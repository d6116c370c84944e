"""`megabeta::history_attention` (megabeta/kernels/history_attention.py): one operator family and
one autograd registration for every implementation, named by the caller. Here: the name is
checked, and the "cpu_fused" implementation (model/attention/merged_op.py) against the float64
reference (support/reference_attention.py), its shift gradient above all: it returns the groups'
shift gradient, and λ's comes through autograd from the shift λ·(m - l)."""

import math

import pytest
import torch

from megabeta.kernels import finished_groups, history_attention
from megabeta.model.attention import merged_op  # noqa: F401  (registers "cpu_fused")
from support.reference_attention import block_attention_grads

L, T, D = 4, 24, 8


def test_an_unknown_implementation_is_refused_by_name() -> None:
    q = torch.zeros(1, 1, 2, 3, D)
    k = torch.zeros(1, 1, 1, 3, D)
    empty = torch.zeros(0)
    with pytest.raises(ValueError, match=r"no implementation 'nope' \(registered: .*'cpu_fused'"):
        history_attention.block(q[0], k[0], k[0], empty, empty, empty, empty,
                                torch.tensor(0), torch.zeros(0, 2), sources=[], layer=0,
                                window=0, scale=1.0, implementation="nope")


@pytest.mark.skipif(not finished_groups.build(),
                    reason="the fused C++ kernels do not build on this machine")
@pytest.mark.parametrize("window", [0, 7], ids=["all-rows", "deep-window"])
def test_cpu_fused_shift_gradient_matches_the_float64_reference(window: int) -> None:
    """Layer 1 reads sources 1, 2, 3 (depth offsets 0, 1, 2) of a history whose rows past the
    block hold garbage; the shift is λ·(m - l) with a fourth, unused group (a wave's width).
    Output, every input's gradient (the shift's, and λ's through it) and the history's, added
    into buffers that start non-zero, match the float64 reference."""
    gen = torch.Generator().manual_seed(window)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    batch, heads, kv, n, start, layer, sources = 2, 4, 2, 5, 13, 1, [1, 2, 3]
    hist_k, hist_v = rand(L, batch, kv, T, D), rand(L, batch, kv, T, D)
    hist_k[:, :, :, start:], hist_v[:, :, :, start:] = float("nan"), float("inf")
    inputs = dict(q=rand(batch, n, heads, D).transpose(1, 2), k=rand(batch, kv, n, D),
                  v=rand(batch, kv, n, D), hist_k=hist_k, hist_v=hist_v,
                  self_bias=rand(1))
    slope = rand(heads).abs().requires_grad_()
    offsets = torch.tensor([m - layer for m in sources] + [0], dtype=torch.float64)
    unused = torch.tensor([0.0, 0.0, 0.0, 5.0], dtype=torch.float64)
    padded = offsets[:, None] * slope + unused[:, None]
    padded.retain_grad()
    grad = rand(batch, heads, n, D)
    leaves = {name: inputs[name].clone().requires_grad_() for name in ("q", "k", "v", "self_bias")}
    grad_k, grad_v = torch.full_like(hist_k, 0.25), torch.full_like(hist_k, -0.5)
    out = history_attention.block(
        leaves["q"], leaves["k"], leaves["v"], hist_k, hist_v, grad_k, grad_v,
        torch.arange(T)[start], padded, leaves["self_bias"], sources=sources, layer=layer,
        window=window, scale=1 / math.sqrt(D), implementation="cpu_fused")
    (out * grad).sum().backward()

    want = block_attention_grads({**inputs, "shift": padded[:3].detach()}, grad, sources=sources,
                                 layer=layer, start=start, window=window, scale=1 / math.sqrt(D))
    tol = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out, want["out"], **tol)
    for name, leaf in leaves.items():
        torch.testing.assert_close(leaf.grad, want[f"d_{name}"], **tol, msg=name)
    torch.testing.assert_close(grad_k - 0.25, want["d_hist_k"], **tol)
    torch.testing.assert_close(grad_v + 0.5, want["d_hist_v"], **tol)
    # The shift's gradient per group (none for the unused fourth), and λ's through it.
    assert want["d_shift"].abs().sum() > 1e-3
    torch.testing.assert_close(padded.grad[:3], want["d_shift"], **tol)
    assert torch.equal(padded.grad[3], torch.zeros(heads, dtype=torch.float64))
    torch.testing.assert_close(slope.grad, (offsets[:3, None] * want["d_shift"]).sum(0), **tol)
