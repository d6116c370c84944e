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

On the CPU flash kernels none of this is needed: merged_attention.py attends to the parts of the
key set separately and merges them by log-sum-exp, with the biases as shifts of the parts' lse;
keys then stay `head_dim` wide (`KeyLayout` without columns).

The history part of the key set comes either as pieces (`KeySet.finished`, concatenated here) or
as `KeySet.stored`, which attends over a history kept in buffers plus the block's own keys (the
"tail": sink and in-block keys); see history.py. Both paths are exact (tests compare them with a
naive reference) and fully differentiable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from megabeta.model.merged_attention import GroupBatch, merged_attention, per_query_head


@dataclass(frozen=True)
class KeyLayout:
    """How keys and values are stored for one model: `head_dim` features, then for the fused path
    a depth column (source layer index) and a self column (sink marker), when used. `merged`:
    the fused path runs on merged_attention.py instead (no columns)."""

    head_dim: int
    depth: bool = False
    self_slot: bool = False
    merged: bool = False

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

    def attend_merged(self, layer: int, q: Tensor, k: Tensor, v: Tensor, slope: Tensor | None,
                      self_bias: Tensor | None, scale: float) -> Tensor: ...


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


def _piece_batches(keys: KeySet) -> list[GroupBatch]:
    """The history pieces as merged_attention's groups: the pieces of one finished group (one
    depth offset) concatenated, and the prefix as a group of offset 0. Read-only (decoding)."""
    groups: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
    for offset, k, v in keys.finished:
        ks, vs = groups.setdefault(offset, ([], []))
        ks.append(k)
        vs.append(v)
    if keys.prefix_k is not None and keys.prefix_k.shape[2] > 0:
        groups.setdefault(0, ([], []))
        groups[0][0].append(keys.prefix_k)
        groups[0][1].append(keys.prefix_v)
    return [GroupBatch(_joined(ks)[None], _joined(vs)[None], [offset])
            for offset, (ks, vs) in groups.items()]


def _joined(pieces: list[Tensor]) -> Tensor:
    """Pieces `[B, H_kv, len, d_h]` as one tensor (no copy for a single piece)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)


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
    if layout.merged and (self_bias is not None or keys.finished or keys.stored is not None):
        if keys.stored is not None:
            return keys.stored.attend_merged(layer, q, keys.k, keys.v, slope, self_bias, scale)
        # One dtype for the kernels (under autocast RoPE leaves q and k float32, v bf16).
        return merged_attention(q, keys.k.to(q.dtype), keys.v.to(q.dtype), _piece_batches(keys),
                                slope, self_bias, scale)
    # (Merged without history or self slot: the depth bias shifts every key alike, softmax
    # ignores it, and the plain causal SDPA below is exact.)
    if not layout.merged and ((slope is not None) != layout.depth
                              or (self_bias is not None) != layout.self_slot):
        raise ValueError("block_attention: key layout does not match the biases in use")
    hist_k, hist_v, _ = _pieces(keys)
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
        q_extra.append((q * per_query_head(keys.k, heads)).sum(-1, keepdim=True)
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
        o = o + p_self * per_query_head(keys.v, heads)
    return o


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
