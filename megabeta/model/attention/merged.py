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

The merge (`_Merged`) is written once; the kernels it calls come from a `CpuKernels` chosen once
per backend. Every kernel is ATen's attention with its lse (which is not differentiable, hence
the custom autograd function); in backward each part's kernel gets the MERGED output and lse
(shifted by the part's depth bias), which makes it produce that part's exact share of the
gradient (as torch's context-parallel ring attention does).

- `CPU_FLASH` (`cpu_flash`): ATen's CPU flash kernels
  (`_scaled_dot_product_flash_attention_for_cpu[_backward]`), which take the float mask. The
  groups: one forward call per stacked batch; in backward one call per group, whose zero-filled
  key/value gradients are added into the history's buffers.
- `CPU_FUSED` (`cpu_fused`): the same, with the groups on the fused kernels of
  `megabeta/kernels/finished_groups.py` (float32/float64; bf16 stays on ATen's): forward merges
  every group into the own keys' output and lse in place; backward adds the keys' and values'
  gradients straight into the history's gradient buffers. Measured at c = 32 (one layer's 15
  blocks with history, batch 8, 3 heads, forward and backward of this whole function): 50 ms
  with the fused kernels against 86-90 ms on ATen's. `fused_cells` runs several cells at once
  (a wave of the wavefront schedule; one block of the block schedule is a wave of one): the
  own keys of all cells in one flash call, every cell's groups in one fused-kernel call.
ATen's kernels that expose the lse have no dropout here: attention dropout runs on the
`explicit` backend.

Document masks (spec §7, `KeySet.documents`): one lower bound per query row. The own keys'
float mask gets -inf on the keys before each query's document (`_own_masks`); on the fused
kernels each row's bound goes to the kernel, which skips the key tiles below a query tile's
smallest bound; on ATen's, the groups are first cut to the rows from the block's smallest bound
on (`_read_from`: groups wholly before it are dropped) and the rest masked per row. A part a
row reads nothing of has lse -inf (ATen's kernel says 0 with a zero output: set to -inf), so
the merge gives it no weight; the self slot keeps every row's merged lse finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from megabeta.kernels import finished_groups
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


@dataclass(frozen=True)
class CpuKernels:
    """The kernels `_Merged` attends to the parts with: ATen's CPU flash kernels;
    `fused_groups`: the groups on megabeta's fused kernels where the dtype allows. Tensors are
    `[B, H, n, d_h]` queries and `[B, H_kv, S, d_h]` keys/values; every lse is `[B, H, n]` in the
    merge's precision (float32, or float64 for float64 inputs), unpadded."""

    fused_groups: bool = False

    def mask_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the own keys' mask is built in, for inputs of `dtype`."""
        # The kernel adds a float mask of the lse's precision (float32 for bf16 inputs).
        return torch.promote_types(dtype, torch.float32)

    def fuses_groups(self, dtype: torch.dtype) -> bool:
        """Whether the groups run on the fused kernels of `megabeta/kernels/finished_groups.py`
        (merged in place; `group_forward`/`group_backward` are then not called)."""
        return self.fused_groups and finished_groups.supports(dtype)

    @property
    def stored_dtypes(self) -> frozenset[torch.dtype] | None:
        """The dtypes a history these kernels read can have (`KeyLayout.dtypes`)."""
        # Under bf16 autocast the fused kernels (and the static block step, which needs them)
        # read a float32 history rather than fall back to the per-group ATen kernels.
        return frozenset(finished_groups.DTYPES) if self.fused_groups else None

    def own_forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None,
                    scale: float) -> tuple[Tensor, Tensor]:
        """Output and lse over the block's own keys, causal, `mask` (`_own_masks`, or None
        without a self bias) added to the scores."""
        out, lse = flash_cpu(q, k, v, dropout_p=0.0, is_causal=True, attn_mask=mask,
                             scale=scale)[:2]
        return out, lse

    def own_backward(self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, *, out: Tensor,
                     lse: Tensor, mask: Tensor | None,
                     scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """The own keys' share of dq, and their dk, dv, for the merged `out` and `lse`."""
        dq, dk, dv = flash_cpu_backward(grad, q, k, v, out, lse, dropout_p=0.0, is_causal=True,
                                        attn_mask=mask, scale=scale)[:3]
        return dq, dk, dv

    def group_forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None,
                      scale: float) -> tuple[Tensor, Tensor]:
        """Output and lse over all of `k/v`, `mask` (a document mask, or None) added to the
        scores."""
        out, lse = flash_cpu(q, k, v, dropout_p=0.0, is_causal=False, attn_mask=mask,
                             scale=scale)[:2]
        return out, lse

    def group_backward(self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, *, out: Tensor,
                       lse: Tensor, mask: Tensor | None,
                       scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """A group's share of dq, and its dk, dv, for the merged `out` and the merged `lse`
        shifted by the group's depth bias."""
        dq, dk, dv = flash_cpu_backward(grad, q, k, v, out, lse, dropout_p=0.0,
                                        is_causal=False, attn_mask=mask, scale=scale)[:3]
        return dq, dk, dv


CPU_FLASH = CpuKernels()
CPU_FUSED = CpuKernels(fused_groups=True)


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
        """On the fused kernels, a wave of several cells in one `fused_cells` call; otherwise
        cell by cell."""
        stored = [key_set.stored for key_set in keys]
        dtype = next((s.dtype for s in stored if s is not None), q.dtype)
        if len(keys) == 1 or dropout_p or not self.kernels.fuses_groups(dtype):
            return super().attend_wave(q, k, v, keys, bias, layers=layers, dropout_p=dropout_p)
        batches = [s.batches(layer) if s is not None else [] for s, layer in zip(stored, layers)]
        documents = [key_set.documents for key_set in keys]
        out = fused_cells(q.to(dtype), k.to(dtype), v.to(dtype), bias.self_bias, bias.slope,
                          batches, 1.0 / math.sqrt(q.shape[-1]),
                          anchors=[s.anchor for s in stored if s is not None],
                          on_backward=[s.done_reading for s in stored if s is not None],
                          documents=None if documents[0] is None else documents)
        return out.transpose(2, 3).to(q.dtype)

    def _static(self, q: Tensor, k: Tensor, v: Tensor, stored: StoredHistory,
                bias: AttentionBias, documents: DocumentBounds | None, *, layer: int,
                scale: float) -> Tensor:
        """A static block step's read (its start is a tensor): the operator of merged_op.py,
        on the fused kernels; the document bounds (spec §7) as a tensor input, so that every
        block still runs the same graph."""
        if not self.kernels.fuses_groups(q.dtype):
            raise RuntimeError(f"{self.name} attention in a static block step needs the fused "
                               f"kernels (cpu_fused, float32 or float64), not {q.dtype}")
        grad_k, grad_v = stored.gradient_buffers()
        return torch.ops.megabeta.merged_attention(
            q, k, v, *stored.buffers(), grad_k, grad_v, stored.start_index(),
            None if documents is None else documents.lower, bias.self_bias, bias.slope,
            stored.anchor, stored.sources(layer), layer, stored.window, scale)[0]


class CpuMergedAttention(_MergedAttention):
    """`cpu_fused` (`fused_kernels=True`) or `cpu_flash`."""

    def __init__(self, head_dim: int, *, fused_kernels: bool) -> None:
        super().__init__(head_dim, kernels=CPU_FUSED if fused_kernels else CPU_FLASH)
        self.name = "cpu_fused" if fused_kernels else "cpu_flash"
        # The static step's operator (merged_op.py) and the batched wave need the fused kernels.
        self.capabilities = Capabilities(devices=frozenset({"cpu"}), dropout=False,
                                         static_step=fused_kernels, batched_waves=fused_kernels,
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
    """Attention `[B, H, n, d_h]` of queries `q` over the groups in `batches`, their own keys
    `k/v [B, H_kv, n, d_h]` (in-block and self slot) and the biases, on `kernels`, each query
    reading only keys of its document (`documents`, spec §7; None: no mask). `anchor` (an
    input whose backward must wait for this one's) and `on_backward` (called when this backward
    is done) let history.py order the finished-KV gradients."""
    if torch.is_grad_enabled() and any(b.grads is None and (b.k.requires_grad or b.v.requires_grad)
                                       for b in batches):
        raise RuntimeError("merged_attention: key groups that require grad need a gradient "
                           "buffer (GroupBatch.grads)")
    if batches and kernels.fuses_groups(q.dtype):
        return fused_cells(q[None], k[None], v[None], bias.self_bias, one_cell(bias.slope),
                           [batches], scale, anchors=[anchor], on_backward=[on_backward],
                           documents=None if documents is None else [documents]).squeeze(0)
    if documents is not None and batches:
        batches = _read_from(batches, int(documents.lower.min()))
    return _Merged.apply(q, k, v, bias.self_bias, bias.slope, anchor, batches, on_backward,
                         scale, kernels, documents)


def _read_from(batches: list[GroupBatch], least: int) -> list[GroupBatch]:
    """`batches` cut to their rows at positions from `least` on (the block's smallest document
    bound, spec §7: no query reads a row before it); groups wholly before it dropped. What the
    fused kernels skip by themselves, for ATen's kernels."""
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


class _Merged(torch.autograd.Function):
    """See the module doc; `self_bias`/`slope` may be None (no self slot / no depth bias).
    The groups on ATen's kernels (on the fused kernels: `fused_cells`)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, self_bias: Tensor | None,
                slope: Tensor | None, anchor: Tensor | None, batches: list[GroupBatch],
                on_backward: Callable[[], None] | None, scale: float,
                kernels: CpuKernels, documents: DocumentBounds | None) -> Tensor:
        out, lse, weighted, weights = merge_forward(q, k, v, self_bias, slope, batches,
                                                    scale=scale, kernels=kernels,
                                                    documents=documents)
        ctx.scale, ctx.batches, ctx.on_backward = scale, batches, on_backward
        ctx.kernels, ctx.documents = kernels, documents
        ctx.has_anchor = anchor is not None
        ctx.save_for_backward(q, k, v, out, lse, self_bias, slope, weighted, weights)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, self_bias, slope, weighted, weights = ctx.saved_tensors
        dq, dk, dv, d_bias, d_slope = merge_backward(
            grad, q, k, v, out, lse, self_bias, slope, weighted, weights, ctx.batches,
            scale=ctx.scale, kernels=ctx.kernels, bias_grad=ctx.needs_input_grad[3],
            documents=ctx.documents)
        if ctx.on_backward is not None:
            ctx.on_backward()
        # The batches are views of the history's buffers: the graph must not keep them alive
        # (with block checkpointing it lives on in a reference cycle until a collection).
        ctx.batches = ()
        d_anchor = grad.new_zeros(()) if ctx.has_anchor else None
        return dq, dk, dv, d_bias, d_slope, d_anchor, None, None, None, None, None


def one_cell(x: Tensor | None) -> Tensor | None:
    """One cell's `x` as a stack of one (`fused_cells`' layout)."""
    return None if x is None else x[None]


def fused_cells(q: Tensor, k: Tensor, v: Tensor, self_bias: Tensor | None, slope: Tensor | None,
                batches: list[list[GroupBatch]], scale: float, *, anchors: list[Tensor | None],
                on_backward: list[Callable[[], None] | None],
                documents: list[DocumentBounds] | None = None) -> Tensor:
    """The merged attention of n cells on the fused kernels (`cpu_fused`, float32/float64):
    queries `q [n, B, H, c, d_h]` over their own keys `k/v [n, B, H_kv, c, d_h]` and their
    finished groups `batches[i]`, with b_σ `self_bias [n]` and λ `slope [n, H]` (either
    None): outputs `[n, B, H, c, d_h]`. A wave's cells (spec §5) read different source layers,
    so their groups' gradients never meet; one cell is a block of the block schedule. Each
    `anchors` entry orders this backward before its producer's, each `on_backward` entry is
    called once it is done (history.py). `documents`: each cell's document bounds (spec §7;
    None: no mask)."""
    held = list({id(a): a for a in anchors if a is not None}.values())
    return _FusedCells.apply(q, k, v, self_bias, slope, batches, on_backward, scale, documents,
                             *held)


class _FusedCells(torch.autograd.Function):
    """`fused_cells`: forward and backward in `fused_cells_forward/backward`."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, self_bias: Tensor | None,
                slope: Tensor | None, batches: list[list[GroupBatch]],
                on_backward: list[Callable[[], None] | None], scale: float,
                documents: list[DocumentBounds] | None, *anchors: Tensor) -> Tensor:
        groups = CellStacks.of(batches, slope, q, documents)
        out, lse = fused_cells_forward(q, k, v, self_bias, slope, groups, scale=scale)
        ctx.scale, ctx.groups, ctx.on_backward = scale, groups, on_backward
        ctx.anchors = len(anchors)
        ctx.save_for_backward(q, k, v, out, lse, self_bias, slope)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, self_bias, slope = ctx.saved_tensors
        dq, dk, dv, d_bias, d_slope = fused_cells_backward(
            grad, q, k, v, out, lse, self_bias, slope, ctx.groups, scale=ctx.scale,
            bias_grad=ctx.needs_input_grad[3])
        for done in ctx.on_backward:
            if done is not None:
                done()
        # The batches are views of the history's buffers: the graph must not keep them alive.
        ctx.groups = None
        anchors = [grad.new_zeros(()) for _ in range(ctx.anchors)]
        return dq, dk, dv, d_bias, d_slope, None, None, None, None, *anchors


def _fold_cells(x: Tensor) -> Tensor:
    """Cells `[n, B, H, …]` as the own keys' kernel takes them: one cell as `[B, H, …]`, several
    as `[n, B·H, …]` (a batch per cell, its rows' heads one after another: GQA's query head
    b·H + h reads KV head b·H_kv + h // (H / H_kv) as it should), copied if need be."""
    return x[0] if x.shape[0] == 1 else x.reshape(x.shape[0], -1, *x.shape[3:])


def _unfold_cells(x: Tensor, cells: int, batch: int) -> Tensor:
    """`_fold_cells`'s inverse (a view)."""
    return x[None] if cells == 1 else x.unflatten(1, (batch, -1))


@dataclass
class CellStacks:
    """The cells' stacks of groups as the fused kernels take them (one call for all cells),
    built once per `fused_cells` call for its forward and backward (`of`)."""

    stacks: list[GroupBatch]
    cells: list[int]
    """Each stack's cell."""
    rows: list[slice]
    """Each stack's groups among its cell's, rows of the `[n, G, …]` tables below."""
    width: int
    """G: the most groups one cell reads."""
    offsets: Tensor | None
    """Each group's depth offset m - l `[n, G]` (padding 0); None: no depth bias shifts one."""
    lower: list[Tensor] | None = None
    """Each cell's document bounds `[B, c]` (spec §7, `DocumentBounds.lower`); None: no mask."""
    own_masks: Tensor | None = None
    """The cells' masks over their own keys `[n, B, c, c]` (`DocumentBounds.own_mask`, what
    `_own_masks` reads)."""

    @staticmethod
    def of(batches: list[list[GroupBatch]], slope: Tensor | None, like: Tensor,
           documents: list[DocumentBounds] | None = None) -> "CellStacks":
        stacks, cells, rows, offsets = [], [], [], []
        for i, cell in enumerate(batches):
            row: list[int] = []
            for b in cell:
                stacks.append(b)
                cells.append(i)
                rows.append(slice(len(row), len(row) + len(b.offsets)))
                row += b.offsets
            offsets.append(row)
        width = max(map(len, offsets))
        table = None
        if slope is not None and any(o for row in offsets for o in row):
            table = torch.tensor([row + [0] * (width - len(row)) for row in offsets],
                                 dtype=like.dtype, device=like.device)
        if documents is None:
            return CellStacks(stacks, cells, rows, width, table)
        dtype = CPU_FUSED.mask_dtype(like.dtype)
        return CellStacks(stacks, cells, rows, width, table, [d.lower for d in documents],
                          consecutive([d.own_mask(dtype) for d in documents]))

    def first(self) -> list[int] | None:
        """Each stack's first row's position, where the kernels read document bounds."""
        return None if self.lower is None else [b.first for b in self.stacks]

    def shift(self, slope: Tensor | None, like: Tensor) -> Tensor:
        """λ_h·(m - l) per cell, group and head `[n, G, H]` (what the kernels subtract)."""
        if self.offsets is None:
            return like.new_zeros(like.shape[0], self.width, like.shape[2])
        return self.offsets[:, :, None] * slope.to(like.dtype)[:, None, :]

    def per_stack(self, table: Tensor) -> list[Tensor]:
        """A `[n, G, …]` table's rows of each stack."""
        return [table[i, r] for i, r in zip(self.cells, self.rows)]


def fused_cells_forward(q: Tensor, k: Tensor, v: Tensor, self_bias: Tensor | None,
                        slope: Tensor | None, groups: "CellStacks", *,
                        scale: float) -> tuple[Tensor, Tensor]:
    """`fused_cells`' output `[n, B, H, c, d_h]` and lse `[n, B, H, c]`: the own keys in one
    kernel call for all cells (the cells' masks `[n, 1, c, c]`), then every cell's groups
    merged in by one call of the fused kernels."""
    n, batch, c = q.shape[0], q.shape[1], q.shape[3]
    mask = _own_masks(c, self_bias, groups.own_masks, q.shape[2], CPU_FUSED.mask_dtype(q.dtype))
    out, lse = CPU_FUSED.own_forward(_fold_cells(q), _fold_cells(k), _fold_cells(v), mask=mask,
                                     scale=scale)
    out, lse = _unfold_cells(out, n, batch), _unfold_cells(lse, n, batch)
    if groups.stacks:
        finished_groups.forward(list(q.unbind()), [b.k for b in groups.stacks],
                                [b.v for b in groups.stacks],
                                groups.per_stack(groups.shift(slope, q)), groups.cells, scale,
                                list(out.unbind()), list(lse.unbind()), lower=groups.lower,
                                first=groups.first())
    return out, lse


def fused_cells_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                         lse: Tensor, self_bias: Tensor | None, slope: Tensor | None,
                         groups: "CellStacks", *, scale: float, bias_grad: bool
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """dq, dk, dv (the own keys), d_self_bias `[n]` (when `bias_grad`) and d_slope `[n, H]`
    (None: no group's depth offset is non-zero) of `fused_cells_forward`; the groups' key and
    value gradients are added into their `GroupBatch.grads()` buffers."""
    n, batch, c = q.shape[0], q.shape[1], q.shape[3]
    mask = _own_masks(c, self_bias, groups.own_masks, q.shape[2], CPU_FUSED.mask_dtype(q.dtype))
    grad = _fold_cells(grad)
    if grad.stride(-1) != 1:
        grad = grad.contiguous()  # the kernels read rows of d numbers
    fq, fk, fv, f_out, f_lse = (_fold_cells(x) for x in (q, k, v, out, lse))
    dq, dk, dv = CPU_FUSED.own_backward(grad, fq, fk, fv, out=f_out, lse=f_lse, mask=mask,
                                        scale=scale)
    # D_i = dO_i·o_i, which the fused kernel and b_σ's gradient read.
    delta = _rowdot(grad, f_out, lse.dtype)
    d_bias = (_self_bias_grad(grad, fq, fk, fv, f_lse, delta, mask, scale=scale, cells=n)
              .to(self_bias.dtype) if bias_grad else None)
    dq = _unfold_cells(dq, n, batch)
    d_slope = None
    if groups.stacks:
        # Each group's lse: the merged one plus its shift, `[n, G, B, H, c]` (a broadcast view
        # when no bias shifts one).
        table = (n, groups.width, *lse.shape[1:])
        lse_g = (lse[:, None].expand(table) if groups.offsets is None
                 else lse[:, None] + groups.shift(slope, q)[:, :, None, :, None])
        rows = lse.new_zeros(table) if groups.offsets is not None else None
        empty = q.new_empty(0)
        # No key/value gradient wanted (decoding): the kernel forms dq only.
        grads = [b.grads() if b.grads is not None else (empty, empty) for b in groups.stacks]
        finished_groups.backward(
            list(_unfold_cells(grad, n, batch).unbind()), list(q.unbind()),
            [b.k for b in groups.stacks], [b.v for b in groups.stacks], groups.per_stack(lse_g),
            list(_unfold_cells(delta, n, batch).unbind()), groups.cells, scale,
            list(dq.unbind()),
            [g for g, _ in grads], [g for _, g in grads],
            [empty] * len(grads) if rows is None else groups.per_stack(rows),
            lower=groups.lower, first=groups.first())
        if rows is not None:
            # Score bias -λ·offset per group: dλ = -Σ offset · (row sums of the group's score
            # gradient), which the kernel summed.
            d_slope = -(rows * groups.offsets.view(n, groups.width, 1, 1, 1)).sum((1, 2, 4))
            d_slope = d_slope.to(slope.dtype)
    return dq, _unfold_cells(dk, n, batch), _unfold_cells(dv, n, batch), d_bias, d_slope


def _has_depth(slope: Tensor | None, batches: list[GroupBatch]) -> bool:
    """Whether a depth bias shifts any group (only then is its gradient formed)."""
    return slope is not None and any(o for b in batches for o in b.offsets)


def merge_forward(q: Tensor, k: Tensor, v: Tensor, self_bias: Tensor | None,
                  slope: Tensor | None, batches: list[GroupBatch], *, scale: float,
                  kernels: CpuKernels, documents: DocumentBounds | None = None
                  ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The merged attention's output (q's dtype) and lse, and, where the depth bias's gradient
    will need them, each group's weighted output and merge weight; the groups on the kernels'
    `group_forward`; `documents`: the queries' bounds (spec §7), None: no mask."""
    # Merged in the kernels' lse precision (float32 for bf16 inputs).
    acc = torch.promote_types(q.dtype, torch.float32)
    mask = _own_mask(q.shape[2], self_bias, documents, kernels.mask_dtype(q.dtype))
    out, lse = kernels.own_forward(q, k, v, mask=mask, scale=scale)
    weighted = weights = None
    if batches:
        own, own_lse = out, lse
        biases = [_bias(slope, b.offsets, acc) for b in batches]
        groups_out, groups_lse = _attend_groups(q, batches, biases, scale, kernels, documents)
        lse = torch.logaddexp(own_lse, torch.logsumexp(groups_lse, dim=0))
        weights = torch.exp(groups_lse - lse)
        weighted = weights.unsqueeze(-1) * groups_out
        out = torch.exp(own_lse - lse).unsqueeze(-1) * own + weighted.sum(0)
        if not _has_depth(slope, batches):
            # Only the depth bias's gradient reads the groups' weighted outputs.
            weighted = weights = None
    return out.to(q.dtype), lse, weighted, weights


def merge_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   self_bias: Tensor | None, slope: Tensor | None, weighted: Tensor | None,
                   weights: Tensor | None, batches: list[GroupBatch], *, scale: float,
                   kernels: CpuKernels, bias_grad: bool, documents: DocumentBounds | None = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """dq, dk, dv (the own keys), d_self_bias (when `bias_grad`) and d_slope of `merge_forward`
    for its `out, lse, weighted, weights`; the groups' key and value gradients are added into
    their `GroupBatch.grads()` buffers."""
    acc = lse.dtype
    mask = _own_mask(q.shape[2], self_bias, documents, kernels.mask_dtype(q.dtype))
    dq, dk, dv = kernels.own_backward(grad, q, k, v, out=out, lse=lse, mask=mask, scale=scale)
    # D_i = dO_i·o_i, which the gradients of both learned biases read.
    delta = _rowdot(grad, out, acc) if bias_grad or weighted is not None else None
    d_bias = (_self_bias_grad(grad, q, k, v, lse, delta, mask, scale=scale, cells=1)
              .to(self_bias.dtype) if bias_grad else None)
    for b in batches:
        bias = _bias(slope, b.offsets, acc)
        group_mask = _group_mask(b, documents, kernels.mask_dtype(q.dtype))
        grad_k, grad_v = b.grads() if b.grads is not None else (None, None)
        # The kernel forms P = exp(S·scale - lse_i) with lse_i = lse + λ·offset: each
        # group's exact share of the merged softmax, depth bias included.
        # (`[g, B, H, n]`: each group's rows contiguous, as the kernels need them.)
        shifted = (lse + bias).unbind() if isinstance(bias, Tensor) else [lse] * len(b.offsets)
        for i, lse_g in enumerate(shifted):
            dq_g, dk_g, dv_g = kernels.group_backward(grad, q, b.k[i], b.v[i], out=out,
                                                      lse=lse_g, mask=group_mask, scale=scale)
            dq += dq_g
            if grad_k is not None:
                grad_k[i].add_(dk_g)
                grad_v[i].add_(dv_g)
    d_slope = None if slope is None else torch.zeros_like(slope)
    if _has_depth(slope, batches):
        # Score bias -λ·offset per group: dλ = -Σ offset · (row sums of the group's score
        # gradient), the row sum being w_g·(dO·o_g - D) with o_g the group's own output.
        d_shift = _rowdot(grad, weighted, acc) - weights * delta
        offsets = torch.tensor([o for b in batches for o in b.offsets], dtype=acc,
                               device=d_shift.device)
        d_slope = -(d_shift * offsets.view(-1, 1, 1, 1)).sum((0, 1, 3)).to(slope.dtype)
    return dq, dk, dv, d_bias, d_slope


def _self_bias_grad(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                    mask: Tensor, *, scale: float, cells: int) -> Tensor:
    """b_σ's gradient `[cells]`, for queries laid out as `cells` equal runs of their batch
    dimension: b_σ is on the mask's diagonal, so its gradient is the diagonal's score gradient
    p_ii·(dO_i·v_i - D_i), with p_ii = exp(q_i·k_i·scale + b_σ - lse_i) and b_σ as the kernel
    added it (rounded to the mask's dtype; `mask` `[cells or 1, 1, n, n]` or `[n, n]`)."""
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


def _attend_groups(q: Tensor, batches: list[GroupBatch], biases: list[Tensor | float],
                   scale: float, kernels: CpuKernels,
                   documents: DocumentBounds | None) -> tuple[Tensor, Tensor]:
    """Each group's own attention output `[G, B, H, n, d_h]` and lse `[G, B, H, n]` (its depth
    bias, from `_bias`, included), one kernel call per batch of stacked groups."""
    outs, lses = [], []
    for b, bias in zip(batches, biases):
        g = len(b.offsets)
        mask = _group_mask(b, documents, kernels.mask_dtype(q.dtype))
        o, lse = kernels.group_forward(q.repeat(g, 1, 1, 1) if g > 1 else q, b.k.flatten(0, 1),
                                       b.v.flatten(0, 1), scale=scale,
                                       mask=mask if mask is None or g == 1
                                       else mask.repeat(g, 1, 1, 1))
        lse = lse.view(g, *q.shape[:3])
        if mask is not None:
            # A row that reads none of the group: ATen's kernel gives lse 0 (and output 0);
            # the empty part's lse is -inf, so that the merge gives it no weight.
            lse = lse.masked_fill(mask[:, :, :, -1] < 0, float("-inf"))
        outs.append(o.view(g, *q.shape))
        lses.append(lse - bias)
    return torch.cat(outs), torch.cat(lses)


def _group_mask(b: GroupBatch, documents: DocumentBounds | None,
                dtype: torch.dtype) -> Tensor | None:
    """The float mask `[B, 1, n, rows]` of one group's rows: -inf on those before each query's
    document (spec §7), 0 elsewhere; None without documents."""
    if documents is None:
        return None
    positions = torch.arange(b.first, b.first + b.k.shape[3], device=b.k.device)
    allowed = documents.allowed(positions)
    return torch.zeros(allowed.shape, dtype=dtype, device=b.k.device).masked_fill_(
        ~allowed, float("-inf"))


def _own_mask(n: int, self_bias: Tensor | None, documents: DocumentBounds | None,
              dtype: torch.dtype) -> Tensor | None:
    """`_own_masks` of one block: `[n, n]` (b_σ alone) or `[B, 1, n, n]` (documents)."""
    own = None if documents is None else documents.own_mask(dtype)[None]
    mask = _own_masks(n, self_bias, own, 1, dtype)
    return mask if mask is None or documents is not None else mask[0, 0]


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


def _bias(slope: Tensor | None, offsets: list[int], dtype: torch.dtype) -> Tensor | float:
    """The depth bias λ_h·(m - l) of each group `[g, 1, H, 1]` (subtracted from its lse)."""
    if slope is None or not any(offsets):
        return 0.0
    steps = torch.tensor(offsets, dtype=dtype, device=slope.device).view(-1, 1, 1, 1)
    return steps * slope.to(dtype).view(1, 1, -1, 1)
