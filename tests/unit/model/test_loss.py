"""The chunked LM-head cross-entropy (model/loss.py) against autograd over the full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megabeta.model.loss import IGNORE_INDEX, linear_cross_entropy


def _inputs(rows: int = 11, width: int = 6, vocab: int = 13,
            dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, width, dtype=dtype, generator=g).requires_grad_()
    weight = torch.randn(vocab, width, dtype=dtype, generator=g).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[[2, 7]] = IGNORE_INDEX
    return h, weight, targets


@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
def test_loss_and_gradients_match_full_logits(chunk: int) -> None:
    """Any chunking (one row, chunks that do not divide the rows, one chunk, a chunk larger
    than the input): the summed loss and both gradients equal autograd's over the whole
    `[rows, vocab]` logits, ignored rows counting nothing. The incoming gradient (here 0.37)
    scales both."""
    h, weight, targets = _inputs()
    expected = F.cross_entropy(h @ weight.t(), targets, ignore_index=IGNORE_INDEX,
                               reduction="sum")
    want_h, want_w = torch.autograd.grad(expected * 0.37, (h, weight))
    loss = linear_cross_entropy(h, weight, targets, chunk)
    got_h, got_w = torch.autograd.grad(loss * 0.37, (h, weight))
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-12)
    assert got_h[[2, 7]].abs().max() == 0


def test_frozen_head_gets_no_gradient_and_no_grad_mode_gives_the_loss() -> None:
    h, weight, targets = _inputs()
    weight.requires_grad_(False)
    linear_cross_entropy(h, weight, targets, 4).backward()
    assert weight.grad is None and h.grad is not None
    with torch.no_grad():
        loss = linear_cross_entropy(h, weight, targets, 4)
    assert not loss.requires_grad
    expected = F.cross_entropy(h @ weight.t(), targets, ignore_index=IGNORE_INDEX,
                               reduction="sum")
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)


def test_second_backward_is_refused_clearly() -> None:
    """The gradients are formed in forward and handed out (scaled in place) once."""
    h, weight, targets = _inputs()
    loss = linear_cross_entropy(h, weight, targets, 4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_autocast_computes_in_bf16_like_f_linear() -> None:
    """Under autocast the head's matmul is bf16, as `F.linear` would be, the softmax float32;
    the gradients come back in the inputs' dtype."""
    h, weight, targets = _inputs(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.cross_entropy(F.linear(h, weight).float(), targets,
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        loss = linear_cross_entropy(h, weight, targets, 4)
    want_h, want_w = torch.autograd.grad(expected, (h, weight))
    got_h, got_w = torch.autograd.grad(loss, (h, weight))
    assert loss.dtype == torch.float32 and got_h.dtype == got_w.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_h, want_h, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_w, want_w, rtol=2e-2, atol=2e-2)
