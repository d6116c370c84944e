"""The block attention contract (spec §3) as one explicit float64 softmax: the reference every
block-attention test compares with (the Triton kernels on CPU and GPU, the model's backends).

One block of n queries at `layer`, starting at token `start`, reads in one softmax:

- each history group g (`sources[g]`, a layer of the `[L, B, H_kv, T, d]` history): rows
  `group_rows(...)` of it, score minus `shift[g, h]`;
- its own n keys, causal, with the self bias b_σ added on the diagonal (the self slot).

Scores are q·k·scale (default 1/√d); query head h reads KV head h // (H / H_kv) (GQA). With
document bounds `lower [B, n]` (spec §7), query r reads only keys at positions >= lower[:, r]
(history row j is position j, own key j is position start + j). It shares no code with
megabeta: a bug in the model's helpers cannot hide in it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

PERTURBATIONS = ("self_bias", "shift_sign", "causal", "window")
"""Terms `perturb` can get wrong, for mutation checks of a comparison: b_σ off by 0.5, the group
shift added instead of subtracted, one future key visible, the window one row short."""


def group_rows(source: int, layer: int, start: int, window: int) -> slice:
    """The history rows a block at `layer` starting at `start` reads from layer `source`: every
    earlier row, or with a deep-token window (> 0) only the last `window` of them for a layer
    deeper than its own."""
    deeper = window > 0 and source > layer
    return slice(max(0, start - window) if deeper else 0, start)


def _per_query_head(x: Tensor, heads: int) -> Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def block_attention(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
                    shift: Tensor, self_bias: Tensor | None, *, sources: Sequence[int],
                    layer: int, start: int, window: int, scale: float | None = None,
                    perturb: str | None = None,
                    lower: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(output `[B, H, n, d]`, log-sum-exp of the scores `[B, H, n]`), computed in the inputs'
    dtype (float64 for a reference). `q [B, H, n, d]`, `k, v [B, H_kv, nk, d]` (nk >= n: the
    block's own keys from its start, query r being own key nk - n + r), `shift [G, H]`,
    `self_bias [1]` or None (no self slot). Rows of the history a block does not read are never
    touched, so they may hold garbage."""
    if perturb not in (None, *PERTURBATIONS):
        raise ValueError(f"unknown perturbation {perturb!r}; one of {PERTURBATIONS}")
    heads, n, nk = q.shape[1], q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    own = q @ _per_query_head(k, heads).transpose(-1, -2) * scale
    # Query r is own key nk - n + r (a decoding prefix of the block comes first).
    diagonal = torch.ones(n, nk, dtype=torch.bool, device=q.device).tril(nk - n).triu(nk - n)
    if self_bias is not None:
        bias = self_bias + (0.5 if perturb == "self_bias" else 0.0)
        own = own + torch.where(diagonal, bias, torch.zeros((), dtype=q.dtype, device=q.device))
    causal = torch.ones(n, nk, dtype=torch.bool, device=q.device).tril(
        nk - n + (1 if perturb == "causal" else 0))
    scores, values = [own.masked_fill(~causal, float("-inf"))], [_per_query_head(v, heads)]
    positions = [torch.arange(start, start + nk)]
    sign = 1.0 if perturb == "shift_sign" else -1.0
    for g, source in enumerate(sources):
        rows = group_rows(source, layer, start, window)
        if perturb == "window" and rows.start > 0:
            rows = slice(rows.start + 1, rows.stop)
        keys = _per_query_head(hist_k[source, :, :, rows], heads)
        scores.append(q @ keys.transpose(-1, -2) * scale + sign * shift[g].view(1, heads, 1, 1))
        values.append(_per_query_head(hist_v[source, :, :, rows], heads))
        positions.append(torch.arange(rows.start, rows.stop))
    s = torch.cat(scores, dim=-1)
    if lower is not None:
        read = torch.cat(positions).to(q.device)[None, None, None, :] >= lower[:, None, :, None]
        s = s.masked_fill(~read, float("-inf"))
    return torch.softmax(s, dim=-1) @ torch.cat(values, dim=2), torch.logsumexp(s, dim=-1)


INPUTS = ("q", "k", "v", "hist_k", "hist_v", "shift", "self_bias")


def block_attention_grads(inputs: dict[str, Tensor | None], grad: Tensor, *,
                          sources: Sequence[int], layer: int, start: int, window: int,
                          scale: float | None = None, perturb: str | None = None,
                          lower: Tensor | None = None) -> dict[str, Tensor | None]:
    """`block_attention` in float64 on the CPU with its gradients: `out`, `lse` and `d_<name>`
    of Σ out·grad for every input of `INPUTS` (zero where the output does not depend on it,
    e.g. history rows not read; None for a missing self bias)."""
    leaves = {name: None if inputs[name] is None
              else inputs[name].detach().double().cpu().clone().requires_grad_()
              for name in INPUTS}
    out, lse = block_attention(*leaves.values(), sources=sources, layer=layer, start=start,
                               window=window, scale=scale, perturb=perturb,
                               lower=None if lower is None else lower.cpu())
    (out * grad.double().cpu()).sum().backward()
    result: dict[str, Tensor | None] = dict(out=out.detach(), lse=lse.detach())
    for name, leaf in leaves.items():
        result[f"d_{name}"] = (None if leaf is None else
                               torch.zeros_like(leaf) if leaf.grad is None else leaf.grad)
    return result
