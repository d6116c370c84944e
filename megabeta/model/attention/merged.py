"""`cpu_flash` and `cpu_fused`: the key set in parts, merged by log-sum-exp.

A block's queries of layer l attend over (spec §3) the finished groups of its source layers, the
construction KVs of earlier tokens of the block (strictly causal) and the self slot. Each part is
attended separately and the parts are merged exactly by their log-sum-exps (the flash-decoding
merge): `lse = logsumexp_p lse_p`, `o = Σ_p exp(lse_p - lse)·o_p`. That is what lets the learned
biases stay out of every kernel:

- depth bias: the bias `-λ_h·(m - l)` is the same for every key of source m's group, so it is a
  shift of that group's lse. Its gradient is the row sum of the group's score gradient (from
  the fused kernel; on ATen's kernels `w_g·(dO·o_g - D)`, with `w_g` the group's merge weight
  and `o_g` its own output kept from the forward).
- the block's own keys (in-block and self slot): one causal kernel call with a float mask
  that carries b_σ on its diagonal. The kernel takes the mask as a constant; b_σ's gradient,
  the diagonal's score gradient `p_ii·(dO_i·v_i - D_i)`, is written out.

So keys and values stay `head_dim` wide everywhere (no extra head columns, no sink key). Groups
that read the same rows of adjacent source layers come stacked (`GroupBatch`, views of the
history's buffers).

The merge is written once, in one autograd function over a stack of n cells (`merged_cells`;
a wave of the wavefront schedule, and one block of the block schedule as a stack of one). The
cells' own keys go to one call of ATen's CPU flash kernel
(`_scaled_dot_product_flash_attention_for_cpu[_backward]`, which takes the float mask and returns
the lse), the cells folded into its batch; the finished groups are merged in by the kernels of
a `CpuKernels`, chosen once per backend. No kernel's lse is differentiable, hence the custom
autograd function; in backward each part's kernel gets the MERGED output and lse (shifted by
the part's depth bias), which makes it produce that part's exact share of the gradient (as
torch's context-parallel ring attention does). The history's ordering (history.py) is kept
there too: its anchors are inputs of the function, whose backward calls each cell's
`on_backward` once the gradients are in the buffers and then drops the groups (views of the
buffers) from the graph.

- `CPU_FLASH` (`cpu_flash`): the groups on ATen's flash kernels as well: per cell one forward
  call per stacked batch, merged by log-sum-exp here; in backward one call per group, whose
  zero-filled key/value gradients are added into the history's buffers.
- `CPU_FUSED` (`cpu_fused`): the groups on the fused kernels of
  `megabeta/kernels/finished_groups.py` (float32/float64; bf16 stays on ATen's): forward merges
  every cell's groups into the own keys' output and lse in place, in one call; backward adds
  the keys' and values' gradients straight into the history's gradient buffers. Measured at
  c = 32 (one layer's 15 blocks with history, batch 8, 3 heads, forward and backward of this
  whole function): 50 ms with the fused kernels against 86-90 ms on ATen's.
ATen's kernels that expose the lse have no dropout here: attention dropout runs on the
`explicit` backend.

Document masks (spec §7, `KeySet.documents`): one lower bound per query row. The own keys'
float mask gets -inf on the keys before each query's document (`_own_masks`); on the fused
kernels each row's bound goes to the kernel, which skips the key tiles below a query tile's
smallest bound; on ATen's, each cell's groups are first cut to the rows from its smallest
bound on (`CpuKernels.readable`: groups wholly before it are dropped) and the rest masked per
row. A part a row reads nothing of has lse -inf (ATen's kernel says 0 with a zero output: set
to -inf), so the merge gives it no weight; the self slot keeps every row's merged lse finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from megabeta.kernels import finished_groups, history_attention
from megabeta.model.attention.backend import (
    AttentionBias,
    Capabilities,
    CellByCell,
    DocumentBounds,
    GroupBatch,
    KeyLayout,
    KeySet,
    StoredHistory,
    WaveBias,
    causal_sdpa,
    consecutive,
    per_query_head,
)


flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class CpuKernels:
    """The kernels that merge the finished groups into the cells' own-key output: here ATen's
    CPU flash kernels, each cell's stacks one call per stack forward (merged by log-sum-exp in
    Python) and one per group backward. Queries `[n, B, H, c, d_h]` (`merged_cells`' cells),
    groups as `CellStacks`; every lse `[n, B, H, c]` in the merge's precision (`_precision`)."""

    fused = False
    """Whether the groups run on megabeta's fused kernels (`FusedKernels`)."""
    stored_dtypes: frozenset[torch.dtype] | None = None
    """The dtypes a history these kernels read can have (`KeyLayout.dtypes`; None: any)."""

    def for_dtype(self, dtype: torch.dtype) -> CpuKernels:
        """The kernels that run inputs of `dtype`."""
        return self

    def readable(self, batches: list[list[GroupBatch]],
                 documents: list[DocumentBounds]) -> list[list[GroupBatch]]:
        """Each cell's groups cut to the rows from its smallest document bound on (spec §7: no
        query of the cell reads a row before it; `_read_from`): ATen's kernels attend to every
        row they are given."""
        return [_read_from(cell, int(bounds.lower.min())) if cell else cell
                for cell, bounds in zip(batches, documents)]

    def merge_groups(self, q: Tensor, out: Tensor, lse: Tensor, slope: Tensor | None,
                     groups: CellStacks, *, scale: float
                     ) -> tuple[Tensor, Tensor, list[Tensor | None]]:
        """The merged output (q's dtype) and lse of each cell's own-key `out, lse` and its
        groups, and what `groups_backward` reads: two entries per cell (flat, as
        `save_for_backward` takes them), its groups' weighted outputs and merge weights where a
        depth bias's gradient will need them, else None and None."""
        if groups.given_shift is not None:
            raise NotImplementedError("merged attention: a given shift table (CellStacks.of's "
                                      "`shift`) is for the fused kernels only")
        shift = None if groups.offsets is None else groups.per_stack(groups.shift(slope, lse))
        outs, lses, kept = [], [], []
        for i, stacks in enumerate(groups.by_cell):
            if not stacks:
                outs.append(out[i])
                lses.append(lse[i])
                kept += (None, None)
                continue
            groups_out, groups_lse = _attend_groups(q[i], groups, stacks, shift, scale)
            merged = torch.logaddexp(lse[i], torch.logsumexp(groups_lse, dim=0))
            weights = torch.exp(groups_lse - merged)
            weighted = weights.unsqueeze(-1) * groups_out
            own = torch.exp(lse[i] - merged).unsqueeze(-1) * out[i]
            outs.append((own + weighted.sum(0)).to(q.dtype))
            lses.append(merged)
            # Only the depth bias's gradient reads the groups' weighted outputs.
            kept += (weighted, weights) if shift is not None else (None, None)
        return _stacked(outs), _stacked(lses), kept

    def reads_delta(self, groups: CellStacks) -> bool:
        """Whether `groups_backward` reads D = rowsum(dO ∘ o)."""
        return groups.offsets is not None

    def groups_backward(self, grad: Tensor, q: Tensor, out: Tensor, lse: Tensor,
                        delta: Tensor | None, slope: Tensor | None, kept: list[Tensor | None],
                        groups: CellStacks, dq: Tensor, *, scale: float) -> Tensor | None:
        """Add the groups' share of the queries' gradient into `dq` and their key and value
        gradients into their `GroupBatch.grads()` buffers; λ's gradient `[n, H]` in the
        merge's precision (None: no group's depth offset is non-zero; the fused kernels: the
        gradient of whatever shifts the groups, `CellStacks.shift_grad`). `kept`: what
        `merge_groups` returned."""
        shifted = groups.per_stack(groups.shifted_lse(lse, slope))
        dtype = _precision(q.dtype)
        cells = list(zip(grad.unbind(), q.unbind(), out.unbind(), dq.unbind()))
        for b, cell, lse_g in zip(groups.stacks, groups.cells, shifted):
            grad_c, q_c, out_c, dq_c = cells[cell]
            mask = _group_mask(b, groups.cell_documents(cell), dtype)
            grad_k, grad_v = b.grads() if b.grads is not None else (None, None)
            for i, lse_i in enumerate(lse_g.unbind()):
                dq_g, dk_g, dv_g = flash_cpu_backward(
                    grad_c, q_c, b.k[i], b.v[i], out_c, lse_i, dropout_p=0.0, is_causal=False,
                    attn_mask=mask, scale=scale)[:3]
                dq_c.add_(dq_g)
                if grad_k is not None:
                    grad_k[i].add_(dk_g)
                    grad_v[i].add_(dv_g)
        if groups.offsets is None:
            return None
        d_slope = []
        for cell, (weighted, weights) in enumerate(zip(kept[::2], kept[1::2])):
            if weighted is None:
                d_slope.append(lse.new_zeros(q.shape[2]))
                continue
            # A group's row sums of its score gradient: w_g·(dO·o_g - D), with o_g its own
            # output.
            rows = _rowdot(grad[cell], weighted, lse.dtype) - weights * delta[cell]
            d_slope.append(_slope_grad(rows, groups.offsets[cell, :weights.shape[0]]))
        return _stacked(d_slope)


class FusedKernels(CpuKernels):
    """The groups on the fused kernels of `megabeta/kernels/finished_groups.py`, every cell's
    in one call each way (float32 and float64; other dtypes on ATen's, `for_dtype`)."""

    fused = True
    # Under bf16 autocast the fused kernels (and the static block step, which needs them)
    # read a float32 history rather than fall back to the per-group ATen kernels.
    stored_dtypes = frozenset(finished_groups.DTYPES)

    def for_dtype(self, dtype: torch.dtype) -> CpuKernels:
        return self if finished_groups.supports(dtype) else CPU_FLASH

    def readable(self, batches: list[list[GroupBatch]],
                 documents: list[DocumentBounds]) -> list[list[GroupBatch]]:
        # The kernels skip the key tiles below a query tile's smallest bound.
        return batches

    def merge_groups(self, q: Tensor, out: Tensor, lse: Tensor, slope: Tensor | None,
                     groups: CellStacks, *, scale: float
                     ) -> tuple[Tensor, Tensor, list[Tensor | None]]:
        finished_groups.forward(list(q.unbind()), [b.k for b in groups.stacks],
                                [b.v for b in groups.stacks],
                                groups.per_stack(groups.shift(slope, lse)), groups.cells, scale,
                                list(out.unbind()), list(lse.unbind()), lower=groups.lower(),
                                first=groups.first())
        return out, lse, []

    def reads_delta(self, groups: CellStacks) -> bool:
        return True

    def groups_backward(self, grad: Tensor, q: Tensor, out: Tensor, lse: Tensor,
                        delta: Tensor | None, slope: Tensor | None, kept: list[Tensor | None],
                        groups: CellStacks, dq: Tensor, *, scale: float) -> Tensor | None:
        shifted = groups.shifted_lse(lse, slope)
        # The groups' row sums of their score gradients, summed by the kernel, where a depth
        # bias's gradient reads them.
        rows = lse.new_zeros(shifted.shape) if groups.shifted else None
        empty = q.new_empty(0)
        # No key/value gradient wanted (decoding): the kernel forms dq only.
        grads = [b.grads() if b.grads is not None else (empty, empty) for b in groups.stacks]
        finished_groups.backward(
            list(grad.unbind()), list(q.unbind()), [b.k for b in groups.stacks],
            [b.v for b in groups.stacks], groups.per_stack(shifted), list(delta.unbind()),
            groups.cells, scale, list(dq.unbind()), [g for g, _ in grads], [g for _, g in grads],
            [empty] * len(grads) if rows is None else groups.per_stack(rows),
            lower=groups.lower(), first=groups.first())
        return None if rows is None else groups.shift_grad(rows)


CPU_FLASH = CpuKernels()
CPU_FUSED = FusedKernels()


class _MergedAttention(CellByCell):
    """A backend of the merged parts on `kernels`."""

    reads_buffers = True

    name: str

    def __init__(self, head_dim: int, *, kernels: CpuKernels) -> None:
        self.layout = KeyLayout(head_dim, dtypes=kernels.stored_dtypes)
        self.kernels = kernels

    def attend(self, q: Tensor, keys: KeySet, bias: AttentionBias, *, layer: int,
               dropout_p: float) -> Tensor:
        if dropout_p:
            raise ValueError(f"{self.name} attention has no dropout (select the explicit backend)")
        scale = 1.0 / math.sqrt(q.shape[-1])
        if keys.stored is not None:
            # In the buffers' dtype (the kernels take one, and autocast does not reach them),
            # returned in the queries' (`KeyLayout.stored_dtype` may have widened it).
            stored, dtype = keys.stored, keys.stored.dtype
            if stored.block_start is None:
                out = self._static(q.to(dtype), keys.k.to(dtype), keys.v.to(dtype), stored,
                                   bias, keys.documents, layer=layer, scale=scale)
            else:
                out = merged_attention(q.to(dtype), keys.k.to(dtype), keys.v.to(dtype),
                                       stored.batches(layer), bias, scale, kernels=self.kernels,
                                       anchor=stored.anchor, on_backward=stored.done_reading,
                                       documents=keys.documents)
            return out.to(q.dtype)
        if bias.self_bias is None and not keys.finished:
            # No groups and no self slot: the depth bias would shift every key alike, which
            # softmax ignores, so plain causal SDPA over (prefix, own keys) is exact. A
            # document mask comes without a prefix (a cache holds one document).
            hist_k, hist_v, _ = keys.history_pieces()
            documents = keys.documents
            allowed = (None if documents is None
                       else documents.allowed(documents.own_positions(q.shape[2])))
            return causal_sdpa(q, torch.cat([*hist_k, keys.k], dim=2),
                               torch.cat([*hist_v, keys.v], dim=2), 0.0, scale, allowed=allowed)
        # One dtype for the kernels (a per-head norm may leave q and k in another than v's).
        return merged_attention(q, keys.k.to(q.dtype), keys.v.to(q.dtype), _piece_batches(keys),
                                bias, scale, kernels=self.kernels, documents=keys.documents)

    def attend_wave(self, q: Tensor, k: Tensor, v: Tensor, keys: list[KeySet], bias: WaveBias,
                    *, layers: list[int], dropout_p: float) -> Tensor:
        """A wave of several cells in one `merged_cells` call; a wave of one cell as the block
        schedule attends (`attend`)."""
        if len(keys) == 1 or dropout_p:
            return super().attend_wave(q, k, v, keys, bias, layers=layers, dropout_p=dropout_p)
        stored = [key_set.stored for key_set in keys]
        dtype = next((s.dtype for s in stored if s is not None), q.dtype)
        batches = [s.batches(layer) if s is not None else [] for s, layer in zip(stored, layers)]
        documents = [key_set.documents for key_set in keys]
        out = merged_cells(q.to(dtype), k.to(dtype), v.to(dtype), bias.self_bias, bias.slope,
                           batches, 1.0 / math.sqrt(q.shape[-1]), kernels=self.kernels,
                           anchors=[s.anchor for s in stored if s is not None],
                           on_backward=[s.done_reading for s in stored if s is not None],
                           documents=None if documents[0] is None else documents)
        return out.transpose(2, 3).to(q.dtype)

    def _static(self, q: Tensor, k: Tensor, v: Tensor, stored: StoredHistory,
                bias: AttentionBias, documents: DocumentBounds | None, *, layer: int,
                scale: float) -> Tensor:
        """A static block step's read (its start is a tensor): `megabeta::history_attention`
        with the fused kernels' implementation ("cpu_fused", merged_op.py), shifted by the
        groups' `bias.group_shift` (λ's gradient comes through it by autograd); the document
        bounds (spec §7) as a tensor input, so that every block still runs the same graph."""
        if not self.kernels.for_dtype(q.dtype).fused:
            raise RuntimeError(f"{self.name} attention in a static block step needs the fused "
                               f"kernels (cpu_fused, float32 or float64), not {q.dtype}")
        sources = stored.sources(layer)
        shift = bias.group_shift
        if shift is None:  # no depth bias: no group's scores are shifted
            shift = q.new_zeros(len(sources), q.shape[1])
        grad_k, grad_v = stored.gradient_buffers()
        return history_attention.block(
            q, k, v, *stored.buffers(), grad_k, grad_v, stored.start_index(), shift,
            bias.self_bias, sources=sources, layer=layer, window=stored.window, scale=scale,
            implementation="cpu_fused", anchor=stored.anchor,
            lower=None if documents is None else documents.lower)


class CpuMergedAttention(_MergedAttention):
    """`cpu_fused` (`fused_kernels=True`) or `cpu_flash`."""

    def __init__(self, head_dim: int, *, fused_kernels: bool) -> None:
        super().__init__(head_dim, kernels=CPU_FUSED if fused_kernels else CPU_FLASH)
        self.name = "cpu_fused" if fused_kernels else "cpu_flash"
        # The static step's operator ("cpu_fused", merged_op.py) needs the fused kernels.
        self.capabilities = Capabilities(devices=frozenset({"cpu"}), dropout=False,
                                         static_step=fused_kernels, batched_waves=True,
                                         documents=True)


def _piece_batches(keys: KeySet) -> list[GroupBatch]:
    """The history pieces as merged_attention's groups: the pieces of one finished group (one
    depth offset, consecutive positions) concatenated, and the prefix as a group of offset 0.
    Read-only (decoding)."""
    groups: dict[int, tuple[list[Tensor], list[Tensor], int]] = {}
    firsts = keys.finished_first or [0] * len(keys.finished)
    for (offset, k, v), first in zip(keys.finished, firsts):
        ks, vs, _ = groups.setdefault(offset, ([], [], first))
        ks.append(k)
        vs.append(v)
    if keys.prefix_k is not None and keys.prefix_k.shape[2] > 0:
        groups.setdefault(0, ([], [], 0))
        groups[0][0].append(keys.prefix_k)
        groups[0][1].append(keys.prefix_v)
    return [GroupBatch(_joined(ks)[None], _joined(vs)[None], [offset], first=first)
            for offset, (ks, vs, first) in groups.items()]


def _joined(pieces: list[Tensor]) -> Tensor:
    """Pieces `[B, H_kv, len, d_h]` as one tensor (no copy for a single piece)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)


def merged_attention(q: Tensor, k: Tensor, v: Tensor, batches: list[GroupBatch],
                     bias: AttentionBias, scale: float, *, kernels: CpuKernels,
                     anchor: Tensor | None = None,
                     on_backward: Callable[[], None] | None = None,
                     documents: DocumentBounds | None = None) -> Tensor:
    """`merged_cells` of one cell: attention `[B, H, n, d_h]` of queries `q` over the groups in
    `batches`, their own keys `k/v [B, H_kv, n, d_h]` (in-block and self slot) and the biases,
    each query reading only keys of its document (`documents`, spec §7; None: no mask)."""
    # `.squeeze(0)`, not `[0]`: its gradient is a view, an index's a zero-filled copy.
    return merged_cells(q[None], k[None], v[None], bias.self_bias, one_cell(bias.slope),
                        [batches], scale, kernels=kernels, anchors=[anchor],
                        on_backward=[on_backward],
                        documents=None if documents is None else [documents]).squeeze(0)


def one_cell(x: Tensor | None) -> Tensor | None:
    """One cell's `x` as a stack of one (`merged_cells`' layout)."""
    return None if x is None else x[None]


def merged_cells(q: Tensor, k: Tensor, v: Tensor, self_bias: Tensor | None,
                 slope: Tensor | None, batches: list[list[GroupBatch]], scale: float, *,
                 kernels: CpuKernels, anchors: list[Tensor | None],
                 on_backward: list[Callable[[], None] | None],
                 documents: list[DocumentBounds] | None = None) -> Tensor:
    """The merged attention of n cells on `kernels`: queries `q [n, B, H, c, d_h]` over their
    own keys `k/v [n, B, H_kv, c, d_h]` and their finished groups `batches[i]`, with b_σ
    `self_bias [n]` and λ `slope [n, H]` (either None): outputs `[n, B, H, c, d_h]`. A wave's
    cells (spec §5) read different source layers, so their groups' gradients never meet; one
    cell is a block of the block schedule. Each `anchors` entry orders this backward before
    its producer's, each `on_backward` entry is called once it is done (history.py).
    `documents`: each cell's document bounds (spec §7; None: no mask)."""
    if torch.is_grad_enabled() and any(b.grads is None and (b.k.requires_grad or b.v.requires_grad)
                                       for cell in batches for b in cell):
        raise RuntimeError("merged_cells: key groups that require grad need a gradient "
                           "buffer (GroupBatch.grads)")
    kernels = kernels.for_dtype(q.dtype)
    if documents is not None:
        batches = kernels.readable(batches, documents)
    groups = CellStacks.of(batches, slope, q, documents)
    held = list({id(a): a for a in anchors if a is not None}.values())
    return _MergedCells.apply(q, k, v, self_bias, slope, groups, on_backward, scale, kernels,
                              *held)


class _MergedCells(torch.autograd.Function):
    """`merged_cells`' gradients: forward and backward in `cells_forward/backward`, then the
    history's callbacks."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, self_bias: Tensor | None,
                slope: Tensor | None, groups: CellStacks,
                on_backward: list[Callable[[], None] | None], scale: float, kernels: CpuKernels,
                *anchors: Tensor) -> Tensor:
        out, lse, kept = cells_forward(q, k, v, self_bias, slope, groups, scale=scale,
                                       kernels=kernels)
        ctx.scale, ctx.groups, ctx.on_backward, ctx.kernels = scale, groups, on_backward, kernels
        ctx.anchors = len(anchors)
        ctx.save_for_backward(q, k, v, out, lse, self_bias, slope, *kept)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, self_bias, slope, *kept = ctx.saved_tensors
        dq, dk, dv, d_bias, d_slope = cells_backward(
            grad, q, k, v, out, lse, self_bias, slope, kept, ctx.groups, scale=ctx.scale,
            kernels=ctx.kernels, bias_grad=ctx.needs_input_grad[3])
        for done in ctx.on_backward:
            if done is not None:
                done()
        # The groups are views of the history's buffers: the graph must not keep them alive
        # (with block checkpointing it lives on in a reference cycle until a collection).
        ctx.groups = None
        anchors = [grad.new_zeros(()) for _ in range(ctx.anchors)]
        return dq, dk, dv, d_bias, d_slope, None, None, None, None, *anchors


def cells_forward(q: Tensor, k: Tensor, v: Tensor, self_bias: Tensor | None,
                  slope: Tensor | None, groups: CellStacks, *, scale: float,
                  kernels: CpuKernels) -> tuple[Tensor, Tensor, list[Tensor | None]]:
    """`merged_cells`' output `[n, B, H, c, d_h]` (q's dtype) and lse `[n, B, H, c]`, and what
    the groups' backward reads (`CpuKernels.merge_groups`): the own keys of all cells in one
    kernel call (the cells' masks `[n, 1, c, c]`), then the groups merged in on `kernels`."""
    n, batch, c = q.shape[0], q.shape[1], q.shape[3]
    mask = _own_masks(c, self_bias, groups.own_masks, q.shape[2], _precision(q.dtype))
    out, lse = flash_cpu(_fold_cells(q), _fold_cells(k), _fold_cells(v), dropout_p=0.0,
                         is_causal=True, attn_mask=mask, scale=scale)[:2]
    out, lse = _unfold_cells(out, n, batch), _unfold_cells(lse, n, batch)
    if not groups.stacks:
        return out, lse, []
    return kernels.merge_groups(q, out, lse, slope, groups, scale=scale)


def cells_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   self_bias: Tensor | None, slope: Tensor | None, kept: list[Tensor | None],
                   groups: CellStacks, *, scale: float, kernels: CpuKernels, bias_grad: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """dq, dk, dv (the own keys), d_self_bias `[n]` (when `bias_grad`) and d_slope `[n, H]`
    (None: no group's depth offset is non-zero; stacks built with a given shift table: that
    table's gradient, `CellStacks.shift_grad`, None without groups) of `cells_forward`'s
    `out, lse, kept`; the groups' key and value gradients are added into their
    `GroupBatch.grads()` buffers."""
    n, batch, c = q.shape[0], q.shape[1], q.shape[3]
    mask = _own_masks(c, self_bias, groups.own_masks, q.shape[2], _precision(q.dtype))
    grad = _fold_cells(grad)
    if grad.stride(-1) != 1:
        grad = grad.contiguous()  # the fused kernels read rows of d numbers
    fq, fk, fv, f_out, f_lse = (_fold_cells(x) for x in (q, k, v, out, lse))
    dq, dk, dv = flash_cpu_backward(grad, fq, fk, fv, f_out, f_lse, dropout_p=0.0,
                                    is_causal=True, attn_mask=mask, scale=scale)[:3]
    # D_i = dO_i·o_i, which b_σ's gradient and the groups' backward read.
    delta = (_rowdot(grad, f_out, lse.dtype)
             if bias_grad or (groups.stacks and kernels.reads_delta(groups)) else None)
    d_bias = (_self_bias_grad(grad, fq, fk, fv, f_lse, delta, mask, scale=scale, cells=n)
              .to(self_bias.dtype) if bias_grad else None)
    dq = _unfold_cells(dq, n, batch)
    d_slope = None
    if groups.stacks:
        d_slope = kernels.groups_backward(
            _unfold_cells(grad, n, batch), q, out, lse,
            None if delta is None else _unfold_cells(delta, n, batch), slope, kept, groups, dq,
            scale=scale)
    return (dq, _unfold_cells(dk, n, batch), _unfold_cells(dv, n, batch), d_bias,
            d_slope if d_slope is None or slope is None else d_slope.to(slope.dtype))


def _fold_cells(x: Tensor) -> Tensor:
    """Cells `[n, B, H, …]` as the own keys' kernel takes them: one cell as `[B, H, …]`, several
    as `[n, B·H, …]` (a batch per cell, its rows' heads one after another: GQA's query head
    b·H + h reads KV head b·H_kv + h // (H / H_kv) as it should), copied if need be."""
    return x[0] if x.shape[0] == 1 else x.reshape(x.shape[0], -1, *x.shape[3:])


def _unfold_cells(x: Tensor, cells: int, batch: int) -> Tensor:
    """`_fold_cells`'s inverse (a view)."""
    return x[None] if cells == 1 else x.unflatten(1, (batch, -1))


def _stacked(parts: list[Tensor]) -> Tensor:
    """Per-cell `parts` as one `[n, …]` (one part: a view)."""
    return parts[0][None] if len(parts) == 1 else torch.stack(parts)


@dataclass
class CellStacks:
    """The cells' stacks of groups, as the kernels take them, built once per `merged_cells`
    call for its forward and backward (`of`)."""

    stacks: list[GroupBatch]
    cells: list[int]
    """Each stack's cell."""
    by_cell: list[list[int]]
    """Each cell's stacks (indices into `stacks`)."""
    rows: list[slice]
    """Each stack's groups among its cell's, rows of the `[n, G, …]` tables below."""
    width: int
    """G: the most groups one cell reads."""
    offsets: Tensor | None
    """Each group's depth offset m - l `[n, G]` (padding 0) in the merge's precision; None: no
    depth bias shifts one."""
    documents: list[DocumentBounds] | None = None
    """Each cell's document bounds (spec §7); None: no mask."""
    own_masks: Tensor | None = None
    """The cells' masks over their own keys `[n, B, c, c]` (`DocumentBounds.own_mask`, what
    `_own_masks` reads)."""
    given_shift: Tensor | None = None
    """The groups' score shifts `[n, G', H]` (G' ≥ G, entries past a cell's groups unused) in
    the merge's precision, given instead of λ and the depth offsets (the static step's
    operator, merged_op.py): `shift` returns them, and the fused backward their gradient
    (`shift_grad`). The fused kernels only."""

    @staticmethod
    def of(batches: list[list[GroupBatch]], slope: Tensor | None, like: Tensor,
           documents: list[DocumentBounds] | None = None, *,
           shift: Tensor | None = None) -> "CellStacks":
        """The stacks of each cell's `batches`, its groups shifted by λ `slope [n, H]` times
        their depth offsets, or by the table `shift [n, G', H]` (not both)."""
        if slope is not None and shift is not None:
            raise ValueError("CellStacks.of: a slope or a shift table, not both")
        stacks, cells, by_cell, rows, offsets = [], [], [], [], []
        for i, cell in enumerate(batches):
            row: list[int] = []
            by_cell.append(list(range(len(stacks), len(stacks) + len(cell))))
            for b in cell:
                stacks.append(b)
                cells.append(i)
                rows.append(slice(len(row), len(row) + len(b.offsets)))
                row += b.offsets
            offsets.append(row)
        width = max(map(len, offsets))
        dtype = _precision(like.dtype)
        table = None
        if slope is not None and any(o for row in offsets for o in row):
            table = torch.tensor([row + [0] * (width - len(row)) for row in offsets],
                                 dtype=dtype, device=like.device)
        if shift is not None:
            if shift.dim() != 3 or shift.shape[0] != len(batches) or shift.shape[1] < width:
                raise ValueError(f"CellStacks.of: the shift table must be [cells, G', H] with "
                                 f"{len(batches)} cells and G' >= {width}, got "
                                 f"{tuple(shift.shape)}")
            shift = shift.to(dtype)
        masks = None if documents is None else consecutive([d.own_mask(dtype)
                                                            for d in documents])
        return CellStacks(stacks, cells, by_cell, rows, width, table, documents, masks, shift)

    def cell_documents(self, cell: int) -> DocumentBounds | None:
        """Cell `cell`'s document bounds (None: no mask)."""
        return None if self.documents is None else self.documents[cell]

    def lower(self) -> list[Tensor] | None:
        """Each cell's bounds `[B, c]` (`DocumentBounds.lower`), as the fused kernels take them."""
        return None if self.documents is None else [d.lower for d in self.documents]

    def first(self) -> list[int] | None:
        """Each stack's first row's position, where the kernels read document bounds."""
        return None if self.documents is None else [b.first for b in self.stacks]

    @property
    def shifted(self) -> bool:
        """Whether a bias may shift some group's scores (so that its gradient is wanted)."""
        return self.offsets is not None or self.given_shift is not None

    def shift(self, slope: Tensor | None, like: Tensor) -> Tensor:
        """λ_h·(m - l) per cell, group and head `[n, G, H]` (what the kernels subtract; zeros
        without a depth offset, in `like`'s dtype, `like` `[n, B, H, …]`), or the given shift
        table's first G groups."""
        if self.given_shift is not None:
            return self.given_shift[:, :self.width]
        if self.offsets is None:
            return like.new_zeros(like.shape[0], self.width, like.shape[2])
        return self.offsets[:, :, None] * slope.to(self.offsets.dtype)[:, None, :]

    def shifted_lse(self, lse: Tensor, slope: Tensor | None) -> Tensor:
        """Each group's lse `[n, G, B, H, c]` for the backward: the merged `lse [n, B, H, c]`
        plus its shift (a broadcast view when no bias shifts one; either way each group's rows
        contiguous, as the kernels read them)."""
        table = (lse.shape[0], self.width, *lse.shape[1:])
        if not self.shifted:
            return lse[:, None].expand(table)
        return lse[:, None] + self.shift(slope, lse)[:, :, None, :, None]

    def shift_grad(self, rows: Tensor) -> Tensor:
        """The gradient of what shifts the groups, from their row sums of their score gradients
        `rows [n, G, B, H, c]`: λ's `[n, H]`, or the given shift table's `[n, G', H]` (the
        shift is subtracted from the scores: minus the row sums over batch and query rows;
        zero past a cell's groups)."""
        if self.given_shift is None:
            return _slope_grad(rows, self.offsets)
        grad = -rows.sum((-3, -1))
        missing = self.given_shift.shape[1] - self.width
        return grad if not missing else torch.cat(
            [grad, grad.new_zeros(grad.shape[0], missing, grad.shape[2])], 1)

    def per_stack(self, table: Tensor) -> list[Tensor]:
        """A `[n, G, …]` table's rows of each stack."""
        return [table[i, r] for i, r in zip(self.cells, self.rows)]


def _precision(dtype: torch.dtype) -> torch.dtype:
    """The merge's precision for inputs of `dtype`: the kernels' lse (float32 for bf16), and
    the dtype of the own keys' mask (the kernel adds a float mask of the lse's precision)."""
    return torch.promote_types(dtype, torch.float32)


def _slope_grad(rows: Tensor, offsets: Tensor) -> Tensor:
    """λ's gradient `[…, H]` from the groups' row sums of their score gradients
    `rows […, G, B, H, c]` and depth offsets `offsets […, G]`: the score bias is -λ·offset per
    group, so dλ = -Σ offset · row sums."""
    return -(rows * offsets[..., None, None, None]).sum((-4, -3, -1))


def _self_bias_grad(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                    mask: Tensor, *, scale: float, cells: int) -> Tensor:
    """b_σ's gradient `[cells]`, for queries laid out as `cells` equal runs of their batch
    dimension: b_σ is on the mask's diagonal, so its gradient is the diagonal's score gradient
    p_ii·(dO_i·v_i - D_i), with p_ii = exp(q_i·k_i·scale + b_σ - lse_i) and b_σ as the kernel
    added it (rounded to the mask's dtype; `mask` as `_own_masks` makes it)."""
    acc, heads = lse.dtype, q.shape[1]
    diagonal = mask.diagonal(0, -2, -1).to(acc)
    self_score = _rowdot(q, per_query_head(k, heads), acc).mul_(scale)
    p_self = self_score.add_(diagonal - lse).exp_()
    d_self = _rowdot(grad, per_query_head(v, heads), acc).sub_(delta)
    return torch.linalg.vecdot(p_self.reshape(cells, -1), d_self.reshape(cells, -1))


def _rowdot(a: Tensor, b: Tensor, acc: torch.dtype) -> Tensor:
    """`Σ_d a·b` over the last dimension in `acc` (one fused pass when no cast is needed)."""
    if a.dtype == acc and b.dtype == acc:
        return torch.linalg.vecdot(a, b)
    return (a * b).sum(-1, dtype=acc)


def _read_from(batches: list[GroupBatch], least: int) -> list[GroupBatch]:
    """`batches` cut to their rows at positions from `least` on (groups wholly before it
    dropped)."""
    cut = []
    for b in batches:
        skip = least - b.first
        if skip <= 0:
            cut.append(b)
        elif skip < b.k.shape[3]:
            grads = None if b.grads is None else (
                lambda grads=b.grads, skip=skip: tuple(g[:, :, :, skip:] for g in grads()))
            cut.append(GroupBatch(b.k[:, :, :, skip:], b.v[:, :, :, skip:], b.offsets, grads,
                                  first=least))
    return cut


def _attend_groups(q: Tensor, groups: CellStacks, stacks: list[int], shift: list[Tensor] | None,
                   scale: float) -> tuple[Tensor, Tensor]:
    """One cell's groups on ATen's kernel, one call per stack (`stacks`, of the cell of queries
    `q [B, H, c, d_h]`): each group's own attention output `[G, B, H, c, d_h]` and lse
    `[G, B, H, c]`, less its depth bias (`shift`: `CellStacks.shift` per stack, None: none)."""
    outs, lses = [], []
    for j in stacks:
        b = groups.stacks[j]
        g = len(b.offsets)
        mask = _group_mask(b, groups.cell_documents(groups.cells[j]), _precision(q.dtype))
        o, lse = flash_cpu(q.repeat(g, 1, 1, 1) if g > 1 else q, b.k.flatten(0, 1),
                           b.v.flatten(0, 1), dropout_p=0.0, is_causal=False, scale=scale,
                           attn_mask=mask if mask is None or g == 1 else mask.repeat(g, 1, 1, 1)
                           )[:2]
        lse = lse.view(g, *q.shape[:3])
        if mask is not None:
            # A row that reads none of the group: ATen's kernel gives lse 0 (and output 0);
            # the empty part's lse is -inf, so that the merge gives it no weight.
            lse = lse.masked_fill(mask[:, :, :, -1] < 0, float("-inf"))
        outs.append(o.view(g, *q.shape))
        lses.append(lse if shift is None else lse - shift[j][:, None, :, None])
    return torch.cat(outs), torch.cat(lses)


def _group_mask(b: GroupBatch, documents: DocumentBounds | None,
                dtype: torch.dtype) -> Tensor | None:
    """The float mask `[B, 1, c, rows]` of one group's rows: -inf on those before each query's
    document (spec §7), 0 elsewhere; None without documents."""
    if documents is None:
        return None
    positions = torch.arange(b.first, b.first + b.k.shape[3], device=b.k.device)
    allowed = documents.allowed(positions)
    return torch.zeros(allowed.shape, dtype=dtype, device=b.k.device).masked_fill_(
        ~allowed, float("-inf"))


def _own_masks(n: int, self_bias: Tensor | None, documents: Tensor | None, heads: int,
               dtype: torch.dtype) -> Tensor | None:
    """The float mask of the cells' own keys, as the own keys' kernel takes the cells
    (`_fold_cells`): b_σ on the diagonal (the self slot; `self_bias [cells]`, or None: 0), 0
    below it (in-block keys), -inf above, and -inf on keys before each query's document (spec
    §7; `documents [cells, B, n, n]`: the cells' masks without b_σ, `DocumentBounds.own_mask`,
    or None). None when neither (the kernel's causal flag is the whole mask). `[cells, 1, n, n]`
    without documents; with them `[B, 1, n, n]` for one cell, `[cells, B·H, n, n]` for several
    (`heads` H). Detached: the kernels take it as a constant, and b_σ's gradient is written out
    by hand. Quadratic in the block: 1 MiB at c = 512, 1 GiB for one block of 16K tokens
    (float32)."""
    if self_bias is None and documents is None:
        return None
    if documents is None:
        cells = self_bias.shape[0]
        mask = torch.full((cells, 1, n, n), float("-inf"), dtype=dtype,
                          device=self_bias.device).triu_(1)
        mask.diagonal(0, -2, -1).copy_(
            self_bias.detach().to(dtype).view(cells, 1, 1).expand(-1, -1, n))
        return mask
    cells = documents.shape[0]
    mask = documents[:, :, None]
    if self_bias is not None:
        # The pass's masks are shared by every layer's cells: b_σ goes on a copy.
        mask = mask.clone()
        mask.diagonal(0, -2, -1).copy_(
            self_bias.detach().to(dtype).view(cells, 1, 1, 1).expand(mask.shape[:-1]))
    return mask[0] if cells == 1 else mask.expand(-1, -1, heads, -1, -1).flatten(1, 2)
