"""One softmax over beta_1.2's key set (spec §3), computed two ways.

A block of `n` consecutive queries of one layer attends to, in this order:

1. finished groups: per source layer m ∈ M(l), finished KVs of tokens before the block, with the
   score bias `-λ_{l,h}·(m - l)` (`depth offset` m - l);
2. construction KVs of earlier tokens of the same block that are not among the queries (the
   `prefix`: non-empty only when decoding continues a partly filled block);
3. construction KVs of the queries themselves: token j is an in-block key for later queries and
   the self slot (bias b_σ) for its own query.

`use_sdpa=False` builds the score matrix and bias literally (matmul, softmax). `use_sdpa=True`
makes ONE `F.scaled_dot_product_attention` call with a constant causal mask. The learnable biases
must not enter through the mask: a mask that requires grad sends SDPA to its slow math kernel
(measured 5x slower on CPU). They enter through extra head dimensions instead:

- depth bias: the query gets `-λ_h/scale`, keys of a finished group get `m - l`;
- self slot: a "sink" key placed before the in-block keys, which every query sees, gets score
  `q_i·k_i·scale + b_σ` (the query carries `q_i·k_i + b_σ/scale` in an extra dimension, the sink a
  one there) and value `e` (one in an extra value dimension). Its output channel is therefore the
  exact softmax weight p_i of the self slot, and `o_i = o'_i + p_i·v_i` adds the self value. With
  the sink in front, the in-block keys shift by one, so query i sees exactly `j < i` through an
  ordinary bottom-right causal mask (`is_causal` when there is no history).

Both paths are exact (tests compare them with a naive reference) and fully differentiable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class KeySet:
    """The keys one block of queries reads; all tensors `[B, H_kv, len, d_h]`."""

    k: Tensor
    """Construction keys of the queries themselves (in-block keys and self slots)."""
    v: Tensor
    finished: list[tuple[int, Tensor, Tensor]] = field(default_factory=list)
    """(depth offset m - l, keys, values) per finished group."""
    prefix_k: Tensor | None = None
    """Construction keys of this block's earlier tokens that are not queries now (decoding)."""
    prefix_v: Tensor | None = None


def block_attention(q: Tensor, keys: KeySet, slope: Tensor | None, self_bias: Tensor | None,
                    use_sdpa: bool, dropout_p: float = 0.0) -> Tensor:
    """Attention output `[B, H, n, d_h]` of queries `q [B, H, n, d_h]` over `keys` (spec §3).

    `slope` is λ per head `[H]` (None: no depth bias); `self_bias` the scalar b_σ (None: 0).
    """
    if use_sdpa:
        return _fused(q, keys, slope, self_bias, dropout_p)
    return _explicit(q, keys, slope, self_bias, dropout_p)


def _pieces(keys: KeySet) -> tuple[list[Tensor], list[Tensor], list[int]]:
    """History pieces (finished groups, then prefix) with each piece's depth offset."""
    ks = [k for _, k, _ in keys.finished]
    vs = [v for _, _, v in keys.finished]
    offsets = [d for d, _, _ in keys.finished]
    if keys.prefix_k is not None and keys.prefix_k.shape[2] > 0:
        ks.append(keys.prefix_k)
        vs.append(keys.prefix_v)
        offsets.append(0)
    return ks, vs, offsets


def _explicit(q: Tensor, keys: KeySet, slope: Tensor | None, self_bias: Tensor | None,
              dropout_p: float) -> Tensor:
    heads, n, head_dim = q.shape[1], q.shape[2], q.shape[3]
    hist_k, hist_v, offsets = _pieces(keys)
    k = torch.cat([*hist_k, keys.k], dim=2)
    v = torch.cat([*hist_v, keys.v], dim=2)
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    # Bias columns: one constant per history piece and head, then the in-block square.
    columns = []
    for offset, piece in zip(offsets, hist_k):
        col = q.new_zeros(heads, 1, piece.shape[2])
        if slope is not None and offset:
            col = col - (slope * offset).view(heads, 1, 1)
        columns.append(col.expand(heads, n, piece.shape[2]))
    allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    square = q.new_zeros(n, n).masked_fill(~allowed, float("-inf"))
    if self_bias is not None:
        square = square + torch.eye(n, dtype=q.dtype, device=q.device) * self_bias
    columns.append(square.expand(heads, n, n))
    bias = torch.cat(columns, dim=2)

    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim) + bias
    probs = F.dropout(torch.softmax(scores, dim=-1), p=dropout_p)
    return probs @ v


def _fused(q: Tensor, keys: KeySet, slope: Tensor | None, self_bias: Tensor | None,
           dropout_p: float) -> Tensor:
    batch, heads, n, head_dim = q.shape
    kv_heads = keys.k.shape[1]
    scale = 1.0 / math.sqrt(head_dim)
    hist_k, hist_v, offsets = _pieces(keys)
    use_depth = slope is not None and any(offsets)
    use_self = self_bias is not None

    if not (use_depth or use_self):
        # Plain causal attention over history + block; the diagonal is the self slot with bias 0.
        k = torch.cat([*hist_k, keys.k], dim=2)
        v = torch.cat([*hist_v, keys.v], dim=2)
        return _sdpa(q, k, v, dropout_p, scale)

    # Key order: history pieces, then the block's keys. With the self slot, a sink goes first and
    # the block's keys shift by one (the last one is never visible: it would be a self key).
    lengths = [p.shape[2] for p in hist_k]
    if use_self:
        sink = keys.k.new_zeros(batch, kv_heads, 1, head_dim)
        k_main = [*hist_k, sink, keys.k[:, :, :-1]]
        v_main = [*hist_v, sink, keys.v[:, :, :-1]]
    else:
        k_main, v_main = [*hist_k, keys.k], [*hist_v, keys.v]
    k = torch.cat(k_main, dim=2)
    v = torch.cat(v_main, dim=2)
    total = k.shape[2]

    # Extra dimensions: [depth offset] then [self]; built as one small [S, extra] table.
    extra = int(use_depth) + int(use_self)
    k_extra = q.new_zeros(total, extra)
    v_extra = q.new_zeros(total, extra)
    q_extra = []
    if use_depth:
        start = 0
        for offset, length in zip(offsets, lengths):
            k_extra[start:start + length, 0] = offset
            start += length
        q_extra.append((-slope / scale).view(1, heads, 1, 1).expand(batch, heads, n, 1))
    if use_self:
        sink_at = sum(lengths)
        k_extra[sink_at, extra - 1] = 1.0
        v_extra[sink_at, extra - 1] = 1.0
        own_k = keys.k.repeat_interleave(heads // kv_heads, dim=1)
        self_score = (q * own_k).sum(-1, keepdim=True) + self_bias / scale
        q_extra.append(self_score)
    q = torch.cat([q, *q_extra], dim=-1)
    k = torch.cat([k, k_extra.expand(batch, kv_heads, total, extra)], dim=-1)
    v = torch.cat([v, v_extra.expand(batch, kv_heads, total, extra)], dim=-1)

    out = _sdpa(q, k, v, dropout_p, scale)
    o = out[..., :head_dim]
    if use_self:
        p_self = out[..., head_dim + extra - 1:head_dim + extra]
        o = o + p_self * keys.v.repeat_interleave(heads // kv_heads, dim=1)
    return o


def _sdpa(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale: float) -> Tensor:
    """SDPA with query r seeing keys `j <= (S - n) + r` (bottom-right causal)."""
    n, total = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if total == n:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                              scale=scale, enable_gqa=gqa)
    mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          scale=scale, enable_gqa=gqa)
