"""`sdpa`: ONE `F.scaled_dot_product_attention` call over the whole key set, any device.

The learnable biases must not enter through the mask: a mask that requires grad sends SDPA to
its slow math kernel (measured 5x slower on CPU). They ride in extra head dimensions instead
(`KeyLayout` with columns):

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

The history comes as pieces (concatenated here) or as buffers; then `_ReadHistory` concatenates
the groups and the block's tail (sink and in-block keys) for the call, and its backward
recomputes the call with autograd, replaying the forward's dropout: exact, with the copies.
This backend carries attention dropout, which the CPU flash kernels lack.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
from torch import Tensor

from megabeta.model.attention.backend import (
    AttentionBias,
    CellByCell,
    KeyLayout,
    KeySet,
    StoredHistory,
    causal_sdpa,
    per_query_head,
)


class SdpaAttention(CellByCell):
    name = "sdpa"
    reads_buffers = True

    def __init__(self, head_dim: int, *, depth_bias: bool, self_slot: bool) -> None:
        self.layout = KeyLayout(head_dim, depth=depth_bias, self_slot=self_slot)

    def attend(self, q: Tensor, keys: KeySet, bias: AttentionBias, *, layer: int,
               dropout_p: float) -> Tensor:
        layout = self.layout
        if (bias.slope is not None) != layout.depth or (bias.self_bias is not None) != layout.self_slot:
            raise ValueError("sdpa attention: key layout does not match the biases in use")
        batch, heads, n, head_dim = q.shape
        scale = 1.0 / math.sqrt(head_dim)
        # The keys after the history (the "tail"): the queries' own keys (in the layout), behind
        # a sink with the self slot; the diagonal then is the self slot with bias 0.
        own_k, own_v = layout.keys(keys.k, layer), layout.values(keys.v)
        k_tail, v_tail, q_extra = own_k, own_v, []
        if layout.depth:
            q_extra.append((-bias.slope / scale).view(1, heads, 1, 1).expand(batch, heads, n, 1))
        if layout.self_slot:
            # The sink (module doc): depth column = this layer, like the in-block keys, so the
            # depth term shifts its score exactly as theirs; a one in the self column of K and V.
            kv_heads = keys.k.shape[1]
            sink_k = layout.keys(keys.k.new_zeros(batch, kv_heads, 1, head_dim), layer)
            sink_k[..., -1] = 1.0
            sink_v = layout.values(keys.v.new_zeros(batch, kv_heads, 1, head_dim))
            sink_v[..., -1] = 1.0
            q_extra.append((q * per_query_head(keys.k, heads)).sum(-1, keepdim=True)
                           + bias.self_bias / scale)
            # In-block keys shift by one behind the sink; the last would only be a self key.
            # (split, not sliced: see layers.Projection.)
            k_tail = torch.cat([sink_k, own_k.split([n - 1, 1], dim=2)[0]], dim=2)
            v_tail = torch.cat([sink_v, own_v.split([n - 1, 1], dim=2)[0]], dim=2)
        q_full = torch.cat([q, *q_extra], dim=-1) if q_extra else q
        if keys.stored is not None:
            dtype = keys.stored.dtype
            out = _ReadHistory.apply(q_full.to(dtype), k_tail.to(dtype), v_tail.to(dtype),
                                     keys.stored.anchor, keys.stored, layer, dropout_p, scale)
        else:
            hist_k, hist_v, _ = keys.history_pieces()
            out = causal_sdpa(q_full, torch.cat([*hist_k, k_tail], dim=2),
                              torch.cat([*hist_v, v_tail], dim=2), dropout_p, scale)
        if not layout.extra:
            return out
        o, _, p_self = out.split([head_dim, int(layout.depth), int(layout.self_slot)], dim=-1)
        if layout.self_slot:
            o = o + p_self * per_query_head(keys.v, heads)
        return o


def _group_views(history: StoredHistory, layer: int) -> list[tuple[Tensor, Tensor, Any, int]]:
    """(keys, values, gradient-buffer getter, index in its batch) per finished group."""
    return [(b.k[i], b.v[i], b.grads, i) for b in history.batches(layer)
            for i in range(len(b.offsets))]


class _ReadHistory(torch.autograd.Function):
    """One SDPA call over a block's finished groups (concatenated) and its tail; backward
    recomputes it with autograd over leaves that alias the buffers and adds the groups'
    gradients into the history's gradient buffers."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k_tail: Tensor, v_tail: Tensor, anchor: Tensor | None,
                history: StoredHistory, layer: int, dropout_p: float, scale: float) -> Tensor:
        ctx.args = history, layer, dropout_p, scale
        ctx.rng = _rng_state(q.device) if dropout_p else None
        ctx.save_for_backward(q, k_tail, v_tail)
        groups = _group_views(history, layer)
        return causal_sdpa(q, torch.cat([*(g[0] for g in groups), k_tail], 2),
                           torch.cat([*(g[1] for g in groups), v_tail], 2), dropout_p, scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        history, layer, dropout_p, scale = ctx.args
        groups = _group_views(history, layer)
        q, k_tail, v_tail = ctx.saved_tensors
        with torch.enable_grad(), _restored_rng(ctx.rng, q.device):
            keys = [k.detach().requires_grad_() for k, _, _, _ in groups]
            values = [v.detach().requires_grad_() for _, v, _, _ in groups]
            leaves = [t.detach().requires_grad_() for t in (q, k_tail, v_tail)]
            out = causal_sdpa(leaves[0], torch.cat([*keys, leaves[1]], 2),
                              torch.cat([*values, leaves[2]], 2), dropout_p, scale)
            dq, dk_tail, dv_tail, *dkv = torch.autograd.grad(out, leaves + keys + values, grad)
        for (_, _, grads, i), dk, dv in zip(groups, dkv[:len(groups)], dkv[len(groups):]):
            grad_k, grad_v = grads()
            grad_k[i].add_(dk)
            grad_v[i].add_(dv)
        history.done_reading()
        d_anchor = grad.new_zeros(()) if ctx.needs_input_grad[3] else None
        return (dq, dk_tail, dv_tail, d_anchor, None, None, None, None)


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored_rng(state: tuple[Tensor, Tensor | None] | None,
                  device: torch.device) -> Iterator[None]:
    """Replay the forward's attention dropout in backward (same RNG state), leaving the caller's
    RNG streams untouched."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
