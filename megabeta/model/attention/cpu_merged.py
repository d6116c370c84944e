"""`cpu_flash` and `cpu_fused`: the key set in parts on CPU kernels, merged by log-sum-exp.

A block's queries of layer l attend over (spec §3) the finished groups of its source layers, the
construction KVs of earlier tokens of the block (strictly causal) and the self slot. Each part is
attended separately and the parts are merged exactly by their log-sum-exps (the flash-decoding
merge): `lse = logsumexp_p lse_p`, `o = Σ_p exp(lse_p - lse)·o_p`. That is what lets the learned
biases stay out of every kernel:

- depth bias: the bias `-λ_h·(m - l)` is the same for every key of source m's group, so it is a
  shift of that group's lse. Its gradient is the row sum of the group's score gradient (from
  the fused kernel; on ATen's kernels `w_g·(dO·o_g - D)`, with `w_g` the group's merge weight
  and `o_g` its own output kept from the forward).
- the block's own keys (in-block and self slot): one causal flash call with a float mask
  that carries b_σ on its diagonal. The kernel takes the mask as a constant; b_σ's gradient,
  the diagonal's score gradient `p_ii·(dO_i·v_i - D_i)`, is written out.

So keys and values stay `head_dim` wide everywhere (no extra head columns, no sink key). Groups
that read the same rows of adjacent source layers come stacked (`GroupBatch`, views of the
history's buffers).

`cpu_fused` runs the groups on the fused kernels of `megabeta/kernels/finished_groups.py`
(float32/float64): forward merges every group into the own keys' output and lse in place;
backward adds the keys' and values' gradients straight into the history's gradient buffers.
`cpu_flash`, and `cpu_fused` for bf16 tensors, run them on ATen's flash kernels: one forward
call per stacked batch; in backward each group's kernel call gets the MERGED output and lse
(shifted by the group's depth bias), which makes it produce that group's exact share of the
gradient, and its zero-filled key/value gradients are added into the buffers. Measured at
c = 32 (one layer's 15 blocks with history, batch 8, 3 heads, forward and backward of this
whole function): 50 ms with the fused kernels against 86-90 ms on ATen's.

ATen's CPU flash kernels (`_scaled_dot_product_flash_attention_for_cpu[_backward]`) are the ones
that expose the lse here, and they have no dropout: attention dropout needs the `sdpa` backend.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from megabeta.kernels import finished_groups
from megabeta.model.attention.backend import (
    AttentionBias,
    GroupBatch,
    KeyLayout,
    KeySet,
    causal_sdpa,
    per_query_head,
)

flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class CpuMergedAttention:
    """`cpu_fused` (`fused_kernels=True`) or `cpu_flash`."""

    reads_buffers = True

    def __init__(self, head_dim: int, *, fused_kernels: bool) -> None:
        self.name = "cpu_fused" if fused_kernels else "cpu_flash"
        self.layout = KeyLayout(head_dim)
        self.fused_kernels = fused_kernels

    def attend(self, q: Tensor, keys: KeySet, bias: AttentionBias, *, layer: int,
               dropout_p: float) -> Tensor:
        if dropout_p:
            raise ValueError(f"{self.name} attention has no dropout (select the sdpa backend)")
        scale = 1.0 / math.sqrt(q.shape[-1])
        if keys.stored is not None:
            # In the buffers' dtype: the kernels take one, and autocast does not reach them.
            stored, dtype = keys.stored, keys.stored.dtype
            return merged_attention(q.to(dtype), keys.k.to(dtype), keys.v.to(dtype),
                                    stored.batches(layer), bias, scale,
                                    fused_kernels=self.fused_kernels, anchor=stored.anchor,
                                    on_backward=stored.done_reading)
        if bias.self_bias is None and not keys.finished:
            # No groups and no self slot: the depth bias would shift every key alike, which
            # softmax ignores, so plain causal SDPA over (prefix, own keys) is exact.
            hist_k, hist_v, _ = keys.history_pieces()
            return causal_sdpa(q, torch.cat([*hist_k, keys.k], dim=2),
                               torch.cat([*hist_v, keys.v], dim=2), 0.0, scale)
        # One dtype for the kernels (under autocast RoPE leaves q and k float32, v bf16).
        return merged_attention(q, keys.k.to(q.dtype), keys.v.to(q.dtype), _piece_batches(keys),
                                bias, scale, fused_kernels=self.fused_kernels)


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


def merged_attention(q: Tensor, k: Tensor, v: Tensor, batches: list[GroupBatch],
                     bias: AttentionBias, scale: float, *, fused_kernels: bool,
                     anchor: Tensor | None = None,
                     on_backward: Callable[[], None] | None = None) -> Tensor:
    """Attention `[B, H, n, d_h]` of queries `q` over the groups in `batches`, their own keys
    `k/v [B, H_kv, n, d_h]` (in-block and self slot) and the biases. `fused_kernels`: the groups
    on megabeta/kernels where the dtype allows. `anchor` (an input whose backward must wait for
    this one's) and `on_backward` (called when this backward is done) let history.py order the
    finished-KV gradients."""
    if torch.is_grad_enabled() and any(b.grads is None and (b.k.requires_grad or b.v.requires_grad)
                                       for b in batches):
        raise RuntimeError("merged_attention: key groups that require grad need a gradient "
                           "buffer (GroupBatch.grads)")
    fused = fused_kernels and bool(batches) and finished_groups.supports(q.dtype)
    return _Merged.apply(q, k, v, bias.self_bias, bias.slope, anchor, batches, on_backward,
                         scale, fused)


class _Merged(torch.autograd.Function):
    """See the module doc; `self_bias`/`slope` may be None (no self slot / no depth bias)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, self_bias: Tensor | None,
                slope: Tensor | None, anchor: Tensor | None, batches: list[GroupBatch],
                on_backward: Callable[[], None] | None, scale: float, fused: bool) -> Tensor:
        # Merged in the kernels' lse precision (float32 for bf16 inputs).
        acc = torch.promote_types(q.dtype, torch.float32)
        mask = None if self_bias is None else _self_mask(q.shape[2], self_bias, acc)
        own, own_lse = flash_cpu(q, k, v, 0.0, True, attn_mask=mask, scale=scale)[:2]
        out, lse, biases, weighted, weights = own, own_lse, [], None, None
        # On the fused kernels the groups merge into the block's own output in place, and in
        # backward the depth bias's row sums come from the kernel, so nothing per group is kept.
        depth = slope is not None and any(o for b in batches for o in b.offsets)
        if batches:
            biases = [_bias(slope, b.offsets, acc) for b in batches]
        if fused:
            for b, bias in zip(batches, biases):
                shift = (bias.view(len(b.offsets), -1) if isinstance(bias, Tensor)
                         else lse.new_zeros(len(b.offsets), q.shape[1]))
                finished_groups.forward(q, b.k, b.v, shift, scale, out, lse)
        elif batches:
            groups_out, groups_lse = _attend_groups(q, batches, biases, scale)
            lse = torch.logaddexp(own_lse, torch.logsumexp(groups_lse, dim=0))
            weights = torch.exp(groups_lse - lse)
            weighted = weights.unsqueeze(-1) * groups_out
            out = torch.exp(own_lse - lse).unsqueeze(-1) * own + weighted.sum(0)
            if not depth:
                # Only the depth bias's gradient reads the groups' weighted outputs.
                weighted = weights = None
        out = out.to(q.dtype)
        ctx.scale, ctx.batches, ctx.biases, ctx.on_backward = scale, batches, biases, on_backward
        ctx.has_anchor, ctx.fused, ctx.depth = anchor is not None, fused, depth
        # The mask is n x n: made again in backward rather than kept per layer.
        ctx.save_for_backward(q, k, v, out, lse, self_bias, slope, weighted, weights)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, self_bias, slope, weighted, weights = ctx.saved_tensors
        scale, acc = ctx.scale, lse.dtype
        mask = None if self_bias is None else _self_mask(q.shape[2], self_bias, acc)
        dq, dk, dv = flash_cpu_backward(grad, q, k, v, out, lse, 0.0, True, attn_mask=mask,
                                        scale=scale)[:3]
        fused, depth = ctx.fused, ctx.depth
        if fused and grad.stride(-1) != 1:
            grad = grad.contiguous()  # the kernel reads rows of d numbers
        # D_i = dO_i·o_i, which the gradients of both learned biases and the fused kernel read.
        delta = (_rowdot(grad, out, acc)
                 if fused or ctx.needs_input_grad[3] or weighted is not None else None)
        d_bias = None
        if ctx.needs_input_grad[3]:
            # b_σ is on the mask's diagonal: its gradient is the diagonal's score gradient
            # p_ii·(dO_i·v_i - D_i), with p_ii = exp(q_i·k_i·scale + b_σ - lse_i).
            heads = q.shape[1]
            self_score = _rowdot(q, per_query_head(k, heads), acc).mul_(scale)
            p_self = self_score.add_(self_bias.to(acc) - lse).exp_()
            d_self = _rowdot(grad, per_query_head(v, heads), acc).sub_(delta)
            d_bias = torch.linalg.vecdot(p_self.flatten(), d_self.flatten()).reshape(1)
            d_bias = d_bias.to(self_bias.dtype)
        row_sums = []
        for b, bias in zip(ctx.batches, ctx.biases):
            grad_k, grad_v = b.grads() if b.grads is not None else (None, None)
            if fused:
                # Each group's lse `[g, B, H, n]` (a broadcast view when no bias shifts it).
                g = len(b.offsets)
                lse_g = lse + bias if isinstance(bias, Tensor) else lse.expand(g, *lse.shape)
                if grad_k is None:  # no key/value gradient wanted: the kernel forms dq only
                    grad_k = grad_v = q.new_empty(0)
                rows = lse.new_zeros(g, *lse.shape) if depth else lse.new_empty(0)
                finished_groups.backward(grad, q, b.k, b.v, lse_g, delta, scale, dq, grad_k,
                                         grad_v, rows)
                row_sums.append(rows)
                continue
            # The kernel forms P = exp(S·scale - lse_i) with lse_i = lse + λ·offset: each
            # group's exact share of the merged softmax, depth bias included.
            # (`[g, B, H, n]`: each group's rows contiguous, as the kernel needs them.)
            shifted = (lse + bias).unbind() if isinstance(bias, Tensor) else [lse] * len(b.offsets)
            for i, lse_g in enumerate(shifted):
                dq_g, dk_g, dv_g = flash_cpu_backward(grad, q, b.k[i], b.v[i], out, lse_g, 0.0,
                                                      False, scale=scale)[:3]
                dq += dq_g
                if grad_k is not None:
                    grad_k[i].add_(dk_g)
                    grad_v[i].add_(dv_g)
        d_slope = None if slope is None else torch.zeros_like(slope)
        if depth:
            # Score bias -λ·offset per group: dλ = -Σ offset · (row sums of the group's score
            # gradient). The fused kernel sums them; otherwise that row sum is
            # w_g·(dO·o_g - D) with o_g the group's own output.
            d_shift = (torch.cat(row_sums) if fused
                       else _rowdot(grad, weighted, acc) - weights * delta)
            offsets = torch.tensor([o for b in ctx.batches for o in b.offsets], dtype=acc)
            d_slope = -(d_shift * offsets.view(-1, 1, 1, 1)).sum((0, 1, 3)).to(slope.dtype)
        if ctx.on_backward is not None:
            ctx.on_backward()
        # The batches are views of the history's buffers: the graph must not keep them alive
        # (with block checkpointing it lives on in a reference cycle until a collection).
        ctx.batches = ctx.biases = ()
        d_anchor = grad.new_zeros(()) if ctx.has_anchor else None
        return dq, dk, dv, d_bias, d_slope, d_anchor, None, None, None, None


def _rowdot(a: Tensor, b: Tensor, acc: torch.dtype) -> Tensor:
    """`Σ_d a·b` over the last dimension in `acc` (one fused pass when no cast is needed)."""
    if a.dtype == acc and b.dtype == acc:
        return torch.linalg.vecdot(a, b)
    return (a * b).sum(-1, dtype=acc)


def _attend_groups(q: Tensor, batches: list[GroupBatch], biases: list[Tensor | float],
                   scale: float) -> tuple[Tensor, Tensor]:
    """Each group's own attention output `[G, B, H, n, d_h]` and lse `[G, B, H, n]` (its depth
    bias, from `_bias`, included), one kernel call per batch of stacked groups."""
    outs, lses = [], []
    for b, bias in zip(batches, biases):
        g = len(b.offsets)
        o, lse = flash_cpu(q.repeat(g, 1, 1, 1) if g > 1 else q, b.k.flatten(0, 1),
                           b.v.flatten(0, 1), 0.0, False, scale=scale)[:2]
        outs.append(o.view(g, *q.shape))
        lses.append(lse.view(g, *q.shape[:3]) - bias)
    return torch.cat(outs), torch.cat(lses)


def _self_mask(n: int, self_bias: Tensor, dtype: torch.dtype) -> Tensor:
    """The float mask `[n, n]` of a block's own keys: b_σ on the diagonal (the self slot), 0
    below it (in-block keys), -inf above. Detached: the kernels take it as a constant, and
    `_Merged` writes b_σ's gradient out. Quadratic in the block: 1 MiB at c = 512, 1 GiB for
    one block of 16K tokens (float32), alive only during one kernel call."""
    mask = torch.full((n, n), float("-inf"), dtype=dtype, device=self_bias.device).triu_(1)
    mask.diagonal().copy_(self_bias.detach().to(dtype).expand(n))
    return mask


def _bias(slope: Tensor | None, offsets: list[int], dtype: torch.dtype) -> Tensor | float:
    """The depth bias λ_h·(m - l) of each group `[g, 1, H, 1]` (subtracted from its lse)."""
    if slope is None or not any(offsets):
        return 0.0
    steps = torch.tensor(offsets, dtype=dtype, device=slope.device).view(-1, 1, 1, 1)
    return steps * slope.to(dtype).view(1, 1, -1, 1)
