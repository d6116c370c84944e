"""The training loss: LM head and next-token cross-entropy in one pass over chunks of tokens.

`[tokens, vocab]` logits are the largest activation of a small model (at batch 8 x 512 and vocab
8192, 134 MB; at t19_flash's 16K tokens and a 55 K vocabulary, 3.6 GB), so they are never held
whole. Each chunk of rows goes through one reused `[chunk, vocab]` buffer: logits, then in place
its log-sum-exp and, when gradients are wanted, its softmax minus the one-hot target, from
which the head's input and weight gradients are formed right away (the head's weight gradient
accumulated over chunks). Backward only scales them by the incoming gradient. Against autograd
over per-chunk log-softmax: no logits or log-probabilities saved for backward, no head matmul recomputed under activation checkpointing, and one buffer per step
instead of fresh 16 MB ones per chunk (vocab 8192), on which the same log-softmax and its
backward once took 4-6x as long in one fresh process as in another (torch profiler, same
shapes; freshly mapped pages are the likely cause, not measured as such).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100
"""Targets equal to this are left out of the loss (PyTorch's cross-entropy convention)."""


def linear_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
    """Summed cross-entropy of the logits `h @ weight.T` (`h [N, d]`, `weight [V, d]`) against
    `targets [N]` (IGNORE_INDEX rows count nothing), `chunk` rows at a time. Computed in
    autocast's dtype when autocast is on (as `F.linear` would be), the softmax in at least
    float32."""
    device = h.device.type
    compute = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
               else torch.promote_types(h.dtype, weight.dtype))
    grad_mode = torch.is_grad_enabled()  # off inside forward: asked here
    wants = (grad_mode and h.requires_grad, grad_mode and weight.requires_grad)
    return _LinearCrossEntropy.apply(h, weight, targets, chunk, compute, wants)


class _LinearCrossEntropy(torch.autograd.Function):
    """See the module doc. Gradients are formed in forward; backward hands them out once."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor, targets: Tensor, chunk: int,
                compute: torch.dtype, wants: tuple[bool, bool]) -> Tensor:
        with torch.autocast(h.device.type, enabled=False):
            loss, grad_h, grad_w = _chunked(h.to(compute), weight.to(compute), targets, chunk,
                                            *wants)
        ctx.grads = (None if grad_h is None else grad_h.to(h.dtype),
                     None if grad_w is None else grad_w.to(weight.dtype))
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: backward ran twice over the same loss "
                               "(retain_graph); its gradients are handed out once")
        # Scaled in place, and the returned tensors are then the only references: autograd
        # takes them as they are (the weight's is as large as the embedding).
        grads = [None if g is None else g.mul_(grad_loss) for g in ctx.grads]
        ctx.grads = None
        return *grads, None, None, None, None


def _chunked(h: Tensor, weight: Tensor, targets: Tensor, chunk: int, want_h: bool,
             want_w: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(summed loss, dloss/dh, dloss/dweight) over chunks of rows, in `h`'s dtype with the
    softmax in at least float32; the gradients None unless wanted."""
    rows, vocab = h.shape[0], weight.shape[0]
    acc = torch.promote_types(h.dtype, torch.float32)
    n_max = min(chunk, rows)
    logits = h.new_empty(n_max, vocab)
    probs = logits if acc == h.dtype else logits.new_empty(n_max, vocab, dtype=acc)
    grad_h = torch.empty_like(h) if want_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device) if want_w else None
    total = torch.zeros((), dtype=acc, device=h.device)
    for start in range(0, rows, chunk):
        part, target = h[start:start + chunk], targets[start:start + chunk]
        n = part.shape[0]
        z = torch.mm(part, weight.t(), out=logits[:n])
        p = z if probs is logits else probs[:n].copy_(z)
        valid = target != IGNORE_INDEX
        index = target.where(valid, 0).unsqueeze(1)
        picked = p.gather(1, index).squeeze(1)
        top = p.amax(1, keepdim=True)
        sums = p.sub_(top).exp_().sum(1, keepdim=True)
        lse = (top + sums.log()).squeeze(1)
        total += (lse - picked).where(valid, 0).sum()
        if not (want_h or want_w):
            continue
        # dloss/dlogits = softmax - onehot(target), zero on ignored rows.
        keep = valid.to(acc).unsqueeze(1)
        p.mul_(keep / sums).scatter_add_(1, index, -keep)
        g = p if probs is logits else logits[:n].copy_(p)
        if want_h:
            torch.mm(g, weight, out=grad_h[start:start + n])
        if want_w:
            if grad_w.dtype == g.dtype:
                grad_w.addmm_(g.t(), part)
            else:
                grad_w += (g.t() @ part).to(acc)
    return total, grad_h, grad_w
