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
(measured 5x slower on CPU). They enter through extra head dimensions instead (`KeyLayout`):

- depth bias: keys carry their source layer index m (construction keys of layer l carry l) and
  the query `-λ_h/scale`, adding `-λ_h·m` to every score. That differs from `-λ_h·(m - l)` by
  `λ_h·l`, the same for all keys of the query, which softmax ignores. Keys get the column once,
  when they are made, so that the per-block key set is a single concatenation.
- self slot: a "sink" key placed before the in-block keys, which every query sees, gets score
  `q_i·k_i·scale + b_σ` (the query carries `q_i·k_i + b_σ/scale` in an extra dimension, the sink a
  one there) and value `e` (one in an extra value dimension). Its output channel is therefore the
  exact softmax weight p_i of the self slot, and `o_i = o'_i + p_i·v_i` adds the self value. With
  the sink in front, the in-block keys shift by one, so query i sees exactly `j < i` through an
  ordinary bottom-right causal mask (`is_causal` when there is no history).

Without history (the first block, or c ≥ T) on the CPU kernels, `_InBlock` needs none of this:
the depth bias shifts every key alike (softmax ignores it), and the self slot is one more part of
a log-sum-exp merge with the strictly causal in-block attention; keys stay `head_dim` wide.

The history part of the key set comes either as pieces (`KeySet.finished`, concatenated here) or
as `KeySet.stored`, which attends over a history kept in buffers plus the block's own keys (the
"tail": sink and in-block keys); see history.py. Both paths are exact (tests compare them with a
naive reference) and fully differentiable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class KeyLayout:
    """How keys and values are stored for one model: `head_dim` features, then for the fused path
    a depth column (source layer index) and a self column (sink marker), when used."""

    head_dim: int
    depth: bool = False
    self_slot: bool = False

    @property
    def extra(self) -> int:
        return int(self.depth) + int(self.self_slot)

    @property
    def width(self) -> int:
        return self.head_dim + self.extra

    def keys(self, k: Tensor, layer: int) -> Tensor:
        """Keys `[B, H_kv, n, d_h]` of (source) layer `layer` in this layout."""
        if not self.extra:
            return k
        wide = F.pad(k, (0, self.extra))
        if self.depth:
            wide[..., self.head_dim] = layer
        return wide

    def values(self, v: Tensor) -> Tensor:
        return F.pad(v, (0, self.extra)) if self.extra else v


class StoredKeys(Protocol):
    """A history kept outside the key set (history.py): attention over it plus a tail of keys."""

    def attend(self, layer: int, q: Tensor, k_tail: Tensor, v_tail: Tensor, dropout_p: float,
               scale: float) -> Tensor: ...


@dataclass
class KeySet:
    """The keys one block of queries reads, `[B, H_kv, len, …]`: the queries' own keys with
    `head_dim` features, the history pieces in the layout (`layout.width`)."""

    k: Tensor
    """Construction keys of the queries themselves (in-block keys and self slots)."""
    v: Tensor
    finished: list[tuple[int, Tensor, Tensor]] = field(default_factory=list)
    """(depth offset m - l, keys, values) per piece of a finished group (a group may come in
    several pieces, e.g. one per earlier block)."""
    prefix_k: Tensor | None = None
    """Construction keys of this block's earlier tokens that are not queries now (decoding)."""
    prefix_v: Tensor | None = None
    stored: StoredKeys | None = None
    """The history as stored keys instead of `finished`/`prefix` pieces (fused path only)."""


def block_attention(q: Tensor, keys: KeySet, layout: KeyLayout, slope: Tensor | None,
                    self_bias: Tensor | None, use_sdpa: bool, layer: int,
                    dropout_p: float = 0.0) -> Tensor:
    """Attention output `[B, H, n, d_h]` of queries `q [B, H, n, d_h]` of `layer` over `keys`.

    `slope` is λ per head `[H]` (None: no depth bias); `self_bias` the scalar b_σ (None: 0).
    The fused path expects keys in `layout` with `layout.depth`/`layout.self_slot` matching
    `slope`/`self_bias`; the explicit path reads only the first `head_dim` features.
    """
    if use_sdpa:
        return _fused(q, keys, layout, slope, self_bias, layer, dropout_p)
    if keys.stored is not None:
        raise ValueError("block_attention: the explicit path needs the history as pieces")
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
    k = torch.cat([*hist_k, keys.k], dim=2)[..., :head_dim]
    v = torch.cat([*hist_v, keys.v], dim=2)[..., :head_dim]
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


def _fused(q: Tensor, keys: KeySet, layout: KeyLayout, slope: Tensor | None,
           self_bias: Tensor | None, layer: int, dropout_p: float) -> Tensor:
    batch, heads, n, head_dim = q.shape
    kv_heads = keys.k.shape[1]
    scale = 1.0 / math.sqrt(head_dim)
    if (slope is not None) != layout.depth or (self_bias is not None) != layout.self_slot:
        raise ValueError("block_attention: key layout does not match the biases in use")
    hist_k, hist_v, _ = _pieces(keys)
    if (self_bias is not None and keys.stored is None and not hist_k
            and cpu_flash(q, dropout_p)):
        # No history: the depth bias shifts every key alike (softmax ignores it) and the self
        # slot is one more part of a log-sum-exp merge; no extra columns, no sink.
        # One dtype for the kernel (under autocast RoPE leaves q and k float32, v bf16).
        return _InBlock.apply(q, keys.k.to(q.dtype), keys.v.to(q.dtype), self_bias, scale)
    # The keys after the history (the "tail"): the queries' own keys (in the layout), behind a
    # sink with the self slot; the diagonal then is the self slot with bias 0.
    own_k, own_v = layout.keys(keys.k, layer), layout.values(keys.v)
    k_tail, v_tail, q_extra = own_k, own_v, []
    if layout.depth:
        q_extra.append((-slope / scale).view(1, heads, 1, 1).expand(batch, heads, n, 1))
    if layout.self_slot:
        # The sink (see module doc): depth column = this layer, like the in-block keys, so the
        # depth term shifts its score exactly as theirs; a one in the self column of K and V.
        sink_k = layout.keys(keys.k.new_zeros(batch, kv_heads, 1, head_dim), layer)
        sink_k[..., -1] = 1.0
        sink_v = layout.values(keys.v.new_zeros(batch, kv_heads, 1, head_dim))
        sink_v[..., -1] = 1.0
        q_extra.append((q * _per_query_head(keys.k, heads)).sum(-1, keepdim=True)
                       + self_bias / scale)
        # In-block keys shift by one behind the sink; the last would only be a self key.
        # (split, not sliced: see layers.Projection.)
        k_tail = torch.cat([sink_k, own_k.split([n - 1, 1], dim=2)[0]], dim=2)
        v_tail = torch.cat([sink_v, own_v.split([n - 1, 1], dim=2)[0]], dim=2)
    q_full = torch.cat([q, *q_extra], dim=-1) if q_extra else q
    if keys.stored is not None:
        out = keys.stored.attend(layer, q_full, k_tail, v_tail, dropout_p, scale)
    else:
        out = sdpa(q_full, torch.cat([*hist_k, k_tail], dim=2),
                   torch.cat([*hist_v, v_tail], dim=2), dropout_p, scale)
    if not layout.extra:
        return out
    o, _, p_self = out.split([head_dim, int(layout.depth), int(layout.self_slot)], dim=-1)
    if layout.self_slot:
        o = o + p_self * _per_query_head(keys.v, heads)
    return o


def _per_query_head(x: Tensor, heads: int) -> Tensor:
    """KV heads `[B, H_kv, …]` repeated for the query heads they serve (GQA); as is without GQA."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def sdpa(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale: float) -> Tensor:
    """SDPA with query r seeing keys `j <= (S - n) + r` (bottom-right causal)."""
    n, total = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if total == n:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                              scale=scale, enable_gqa=gqa)
    mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          scale=scale, enable_gqa=gqa)


FLASH_ON_CPU = True
"""Use the CPU flash kernels and log-sum-exp merges (here and in history.py). Tests switch it off
to check the paths that other devices use."""

flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def cpu_flash(q: Tensor, dropout_p: float) -> bool:
    """Whether the CPU flash kernels (which return the log-sum-exp) serve these queries."""
    return FLASH_ON_CPU and q.device.type == "cpu" and dropout_p == 0.0


class _InBlock(torch.autograd.Function):
    """Queries of a block with no history over their own keys: key j < i with its plain score,
    and the self slot, key i with score `q_i·k_i·scale + b_σ` (spec §3).

    Two parts merged by log-sum-exp: strictly causal attention (queries 1…n-1 over keys 0…n-2,
    one flash call; query 0 has none) and the self slot (one score per query). In backward the
    flash kernel gets the merged output and lse, which makes it produce its part's exact share;
    the self slot's gradients are written out: with `p` its weight and `D = rowsum(dO ∘ out)`,
    `ds = p·(dO·v_i - D)` is its score's gradient.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, self_bias: Tensor,
                scale: float) -> Tensor:
        heads, n = q.shape[1], q.shape[2]
        # Merged in the kernels' lse precision (float32 for bf16 inputs).
        acc = torch.promote_types(q.dtype, torch.float32)
        k_own, v_own = _per_query_head(k, heads), _per_query_head(v, heads)
        self_score = (q * k_own).sum(-1, dtype=acc) * scale + self_bias.to(acc)
        lse, out = self_score, v_own.clone()
        if n > 1:
            part, part_lse = flash_cpu(q[:, :, 1:], k[:, :, :-1], v[:, :, :-1], 0.0, True,
                                       scale=scale)
            # Query 0 sees no earlier key: its lse is its self score alone. (Rows written in
            # place, not concatenated: full-size copies are most of what this path adds.)
            lse = self_score.clone()
            lse[:, :, 1:] = torch.logaddexp(part_lse, self_score[:, :, 1:])
            out = torch.exp(self_score - lse).unsqueeze(-1) * v_own
            out[:, :, 1:] += torch.exp(part_lse - lse[:, :, 1:]).unsqueeze(-1) * part
            out = out.to(q.dtype)
        ctx.scale, ctx.bias_dtype = scale, self_bias.dtype
        ctx.save_for_backward(q, k, v, out, lse, self_score)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, self_score = ctx.saved_tensors
        scale, heads, n = ctx.scale, q.shape[1], q.shape[2]
        grad = grad.contiguous()
        k_own, v_own = _per_query_head(k, heads), _per_query_head(v, heads)
        p_self = torch.exp(self_score - lse)
        ds = p_self * (grad * (v_own - out)).sum(-1, dtype=lse.dtype)
        dq = (ds.unsqueeze(-1) * scale * k_own).to(q.dtype)
        dk = _per_kv_head((ds.unsqueeze(-1) * scale * q).to(k.dtype), k.shape[1])
        dv = _per_kv_head((p_self.unsqueeze(-1) * grad).to(v.dtype), k.shape[1])
        if n > 1:
            dq_part, dk_part, dv_part = flash_cpu_backward(
                grad[:, :, 1:], q[:, :, 1:], k[:, :, :-1], v[:, :, :-1], out[:, :, 1:],
                lse[:, :, 1:].contiguous(), 0.0, True, scale=scale)
            dq[:, :, 1:] += dq_part
            dk[:, :, :-1] += dk_part
            dv[:, :, :-1] += dv_part
        return dq, dk, dv, ds.sum().reshape(1).to(ctx.bias_dtype), None


def _per_kv_head(x: Tensor, kv_heads: int) -> Tensor:
    """Gradients of query heads `[B, H, …]` summed onto the KV heads they share (GQA)."""
    if x.shape[1] == kv_heads:
        return x
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads)).sum(2)
