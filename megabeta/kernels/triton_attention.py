"""The attention of one block, or of a wave's cells, as Triton kernels: one forward and one
backward launch for all of them.

Spec §3: the queries of a block of n tokens at layer l attend in ONE softmax to the finished
groups of their source layers m ∈ M(l) (history rows [lo_g, start), score shifted by the depth
bias λ_h·(m - l)), to the block's earlier construction keys (causal) and to their own key (the
self slot, score plus b_σ). The CPU path (`model/attention/merged.py`) attends to those parts
separately and merges them by log-sum-exp; here the parts are simply consecutive key tiles of one
flash-attention style online softmax, so nothing per part is ever materialised:

- Forward (`_forward_kernel`, grid (query tiles, B·H, cells)): each program walks the own keys'
  tiles (causal, b_σ on the diagonal) and then each group's tiles of the history buffer
  `[L, B, H_kv, T, d]` (source layer m_g, score minus `shift[g, h]`), keeping a running max and
  sum. It writes the output and the natural-log lse of the full biased, scaled scores.
- Backward (`_backward_kernel`, one launch): two kinds of program in one grid, independent of
  each other. Key programs own one (cell, b, kv head, part, key tile), part = own keys or group
  g; they loop over the query heads that read that kv head and over the n query rows, recompute
  P from the saved lse, and write dK/dV (own keys) or ADD them into the history's float32
  gradient buffers at exactly their rows (groups). Each row of a buffer has one owner, so no
  atomics and a fixed summation order: gradients are bitwise reproducible. Query programs own
  one (cell, b, head, query tile): they form dQ over all keys and write per-row sums of the
  score gradient per group (the depth bias's gradient) and of its diagonal (b_σ's), which one
  torch `.sum` reduces after the launch. delta = rowsum(dO∘O) is recomputed in every program
  from the saved output.

Cells. One call computes `cells` blocks stacked on a leading axis (`[cells, B, H, n, d]`): one
block of the block schedule is one cell; a wave of the wavefront schedule (spec §5,
model/wavefront.py) is up to ⌈L/(k+1)⌉ cells on consecutive blocks, oldest first, at layers
that step by a constant (-(k+1)). Cell i's block starts (cells-1-i)·n rows before the last
cell's, and its layer and its source layers are the last cell's moved by the layer step, the
sources cut at the deepest layer `top` (M(l) = {l, l+s, …} ∩ [l, min(l+k, L-1)]). The cells of
a wave read disjoint source layers (M(l) ⊆ [l, l+k]), so their key programs never write the same
gradient rows: still no atomics.

Static shapes: the valid history length `start` is a device tensor read inside the kernels;
the grids cover all T history rows (key programs past `start` find no rows and store nothing),
so one compiled graph / CUDA graph serves every block. History rows >= start are never loaded
unmasked (they may hold anything, NaN included). Rows [lo_g, start) of source m_g, with
lo_g = max(0, start - window) for a deeper source under a deep-token window (history.group_rows).

The source layers must be an arithmetic progression (as M(l) of spec §3 always is): the kernels
get the first one and the step, so that the group list needs no device table.

Head widths need not be powers of two (t19_flash: 200): tiles are padded to the next power of two
with masks. Inputs float32, bfloat16 or float16, accumulation in float32; float32 products are
exact IEEE ones (no TF32).

Operators: these kernels are the "triton" implementation of `megabeta::history_attention` and
its `_forward`/`_backward` (`megabeta/kernels/history_attention.py`, all over stacked cells: the
gradient protocol and fake implementations live there, once for every implementation),
registered on import (`_forward_impl`, `_backward_impl`). Typed wrappers: `forward`, `backward`
(no autograd) and `block_attention` for one block, `wave_attention` for a wave's cells.
"""

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from megabeta.kernels import history_attention
from megabeta.kernels.history_attention import (
    block_top,
    empty_outputs,
    gradient_like,
    one,
    row_major,
)
from megabeta.kernels.ops import launch, target_device_type

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: `available()` is False and nothing below is defined
    triton = None

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def available() -> bool:
    """Whether triton is importable (the kernels and ops below exist)."""
    return triton is not None


@dataclass(frozen=True)
class Tiles:
    """One kernel's tile sizes and launch options."""

    block_m: int
    """Query rows per tile."""
    block_n: int
    """Key rows per tile."""
    num_warps: int
    num_stages: int | None
    """Software-pipelining depth of the key loops (None: Triton's default)."""


INTERPRETER_TILES = Tiles(16, 16, 1, None)
"""Under Triton's CPU interpreter every program runs in numpy: small tiles keep test grids
cheap."""


@functools.lru_cache(maxsize=None)
def cuda_tiles(block_d: int, dtype: torch.dtype, *, backward: bool) -> Tiles:
    """The tiles of the forward or the backward kernel on a CUDA GPU, for heads padded to
    `block_d` columns: the one place they are chosen. The figures behind them are ptxas's
    register and spill counts of sm_80 and sm_90 builds with triton 3.6 and 3.9
    (`megabeta bench kernels`; docs/benchmarks/2026-12-04-kernels.md), not timings: at c = 32
    the finished groups' attention is bound by HBM bandwidth (`megabeta bench roofline`), so
    tiles that never spill come before the widest MMA.

    - Forward, 16-bit: 64x64 tiles on 4 warps (wgmma on sm_90) up to 128 columns; wider heads
      32x32 on 8 warps (a 64-wide key tile spills at 256 columns).
    - Backward, 16-bit: each key program holds two float32 [BLOCK_N, BLOCK_D] accumulators
      (dK, dV) and recomputes [BLOCK_M, BLOCK_N] scores: 32x32 on 4 warps up to 128 columns
      (32x64 spills on sm_80, 64x64 everywhere); wider heads 32x16 on 8 warps (32x32 spills).
    - float32 (exact IEEE products, no tensor cores): forward 32x16 on 4 warps up to 128
      columns (16x16 spills with triton 3.6 on sm_90), 16x16 on 8 warps wider. Backward 16x16
      without software pipelining (num_stages = 1), whose prefetch buffers otherwise push
      ptxas to spill kilobytes a thread at 256 columns; it still spills about 0.6 KB a thread
      there (every other tiling tried spills more).
    """
    wide = block_d > 128
    if dtype.itemsize > 2:
        if backward:
            return Tiles(16, 16, 8 if wide else 4, 1)
        return Tiles(16, 16, 8, None) if wide else Tiles(32, 16, 4, None)
    if not backward:
        return Tiles(32, 32, 8, None) if wide else Tiles(64, 64, 4, None)
    return Tiles(32, 16, 8, None) if wide else Tiles(32, 32, 4, None)


@dataclass(frozen=True)
class Cells:
    """The geometry of one call: which layer and source layers each cell has (module doc)."""

    count: int
    groups: int
    """G: the most source layers a cell reads (the last cell's)."""
    first: int
    """Cell 0's first source layer (0 when G = 0)."""
    step: int
    """The step between a cell's source layers (1 when it has at most one)."""
    top: int
    """The deepest source layer any cell reads: cell i reads sources first_i + g·step ≤ top,
    g < G."""
    layer: int
    """Cell 0's layer."""
    layer_step: int
    """Cell i's layer (and first source) is cell 0's plus i·layer_step."""

    @staticmethod
    def of(sources: list[int], layers: list[int], top: int) -> "Cells":
        """`sources`: the last cell's source layers, an arithmetic progression; `layers`: each
        cell's layer, an arithmetic progression; `top`: the deepest source layer."""
        if not layers:
            raise ValueError("block attention: no cells (layers is empty)")
        layer_step = layers[1] - layers[0] if len(layers) > 1 else 0
        if any(b - a != layer_step for a, b in zip(layers, layers[1:])):
            raise ValueError(f"block attention: the cells' layers must step by one constant, "
                             f"got {layers}")
        if not sources:
            return Cells(len(layers), 0, 0, 1, 0, layers[0], layer_step)
        step = sources[1] - sources[0] if len(sources) > 1 else 1
        if step <= 0 or any(b - a != step for a, b in zip(sources, sources[1:])):
            raise ValueError(f"block attention: sources must be increasing with one step (M(l) "
                             f"of spec §3), got {sources}")
        if sources[-1] > top:
            raise ValueError(f"block attention: source {sources[-1]} is deeper than top {top}")
        return Cells(len(layers), len(sources), sources[0] + layers[0] - layers[-1], step, top,
                     layers[0], layer_step)

    def sources(self, i: int) -> list[int]:
        """Cell i's source layers."""
        first = self.first + i * self.layer_step
        return [m for m in range(first, first + self.groups * self.step, self.step)
                if m <= self.top]

    def layers(self) -> list[int]:
        return [self.layer + i * self.layer_step for i in range(self.count)]

    def args(self) -> tuple[int, ...]:
        """The kernels' scalar arguments (CELLS, G, src0, src_step, src_top, layer0,
        layer_step)."""
        return (self.count, self.groups, self.first, self.step, self.top, self.layer,
                self.layer_step)


def _per_cell(t: Tensor) -> Tensor:
    """`t [cells, …]` in float32 with each cell's entries contiguous (a strided view of a stack
    of cells stays as it is: the kernels take the cell stride)."""
    t = t.to(torch.float32)
    return t if t[:1].is_contiguous() else t.contiguous()


def _hist_strides(t: Tensor, groups: int, width: int) -> tuple[int, ...]:
    """Strides (l, b, h, t) of a history buffer. When no group reads it (any shape): zeros and
    the row stride a real one has (`width`), so that Triton specialises a first block's launch
    like the others' (no compile of its own)."""
    return tuple(t.stride()[:4]) if groups else (0, 0, 0, width)


def _check(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, shift: Tensor,
           self_bias: Tensor | None, cells: Cells) -> None:
    """Shapes and dtypes the kernels assume (they would read out of bounds otherwise)."""
    count, batch, heads, n, width = q.shape
    groups = cells.groups
    dtypes = {t.dtype for t in ((q, k, v, hist_k, hist_v) if groups else (q, k, v))}
    if len(dtypes) > 1:
        raise ValueError(f"block attention: q, k, v and the history need one dtype, got {dtypes}")
    if count != cells.count:
        raise ValueError(f"block attention: {count} cells of queries for {cells.count} layers")
    if k.shape != (count, batch, k.shape[2], n, width) or v.shape != k.shape \
            or heads % k.shape[2]:
        raise ValueError(f"block attention: k, v must be [cells, B, H_kv, n, d] with H a "
                         f"multiple of H_kv (q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)})")
    if shift.dim() != 3 or shift.shape[0] != count or shift.shape[1] < groups \
            or shift.shape[2] != heads:
        raise ValueError(f"block attention: shift must be [cells, G, H] = [{count}, {groups}, "
                         f"{heads}] (G or more groups), got {tuple(shift.shape)}")
    if self_bias is not None and self_bias.shape != (count,):
        raise ValueError(f"block attention: self_bias must be [cells] = [{count}], got "
                         f"{tuple(self_bias.shape)}")
    if groups:
        if hist_k.dim() != 5 or hist_k.shape[1:3] != k.shape[1:3] or hist_k.shape[4] != width \
                or hist_v.shape != hist_k.shape:
            raise ValueError(f"block attention: history buffers must be [L, B, H_kv, T, d] "
                             f"(got {tuple(hist_k.shape)}, {tuple(hist_v.shape)})")
        read = [m for i in range(count) for m in cells.sources(i)]
        if min(read, default=0) < 0 or cells.top >= hist_k.shape[0]:
            raise ValueError(f"block attention: sources {sorted(set(read))} outside the "
                             f"history's {hist_k.shape[0]} layers")


if triton is not None:
    # Globals that kernels read must be constexprs (the interpreter alone would accept floats).
    _LOG2E = tl.constexpr(LOG2E)
    _LN2 = tl.constexpr(LN2)

    @triton.jit
    def _online_step(acc, m_i, l_i, s, v, DOT_PREC: tl.constexpr):
        """One key tile of the online softmax (scores `s` in log2 units, -inf where masked)."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        return acc, m_new, l_i

    @triton.jit
    def _cell(cell, start_ptr, CELLS, n, G, src0, src_step, src_top, layer0, layer_step):
        """Cell `cell`'s (start, layer, first source, groups) (`Cells`): consecutive blocks of
        n rows, the last one starting at `*start_ptr`; layer and sources moving by
        `layer_step` per cell, sources cut at `src_top`."""
        start = tl.load(start_ptr).to(tl.int32) - (CELLS - 1 - cell) * n
        layer = layer0 + cell * layer_step
        first = src0 + cell * layer_step
        groups = tl.where(first > src_top, 0,
                          tl.minimum(G, (src_top - first) // src_step + 1))
        return start, layer, first, groups

    @triton.jit
    def _group_lo(start, window, source, layer):
        """First history row a group reads (history.group_rows)."""
        return tl.where((window > 0) & (source > layer), tl.maximum(start - window, 0), 0)

    @triton.jit
    def _tile(base, rows, stride, offs_d, mask):
        """Rows `rows` of a `[rows, d]` matrix at `base` (row stride `stride`), 0 where masked."""
        return tl.load(base + rows[:, None] * stride + offs_d[None, :], mask=mask, other=0.0)

    @triton.jit
    def _layer_base(ptr, source, s_l, b, s_b, hkv, s_h):
        """Where (source layer, batch, KV head) starts in a `[L, B, H_kv, T, d]` buffer."""
        return ptr + source.to(tl.int64) * s_l + b * s_b + hkv * s_h

    @triton.jit
    def _row_bounds(doc_ptr, sdoc_n, offs_m, m_mask):
        """Spec §7: the first key position each query row of a tile may read (its document's
        start; `doc_ptr` at the cell's and batch's `[n]` bounds), and the tile's smallest (rows
        past n do not count)."""
        lower = tl.load(doc_ptr + offs_m * sdoc_n, mask=m_mask, other=0).to(tl.int32)
        return lower, tl.min(tl.where(m_mask, lower, 2147483647), 0)

    @triton.jit
    def _first_tile(lo, bound, BLOCK_N: tl.constexpr):
        """Where a loop over key tiles from row `lo` (by BLOCK_N) starts when keys below
        `bound` are masked: the tile holding `bound`. The tiles wholly below it are skipped
        (spec §7: the mask saves their loads and products)."""
        return lo + tl.maximum(bound - lo, 0) // BLOCK_N * BLOCK_N

    # Not specialised: the runtime geometry (one compiled kernel for every block and wave), and
    # the bias entries' strides and pointers (one scalar load each: alignment buys nothing).
    # The document bounds (HAS_DOCS) likewise: a block's slice starts at any position.
    @triton.jit(do_not_specialize=["n", "CELLS", "G", "src0", "src_step", "src_top", "layer0",
                                   "layer_step", "window", "ssh_c", "ssb_c", "sdoc_c", "sdoc_b"],
                do_not_specialize_on_alignment=["shift_ptr", "sb_ptr", "doc_ptr"])
    def _forward_kernel(q_ptr, k_ptr, v_ptr, hk_ptr, hv_ptr, start_ptr, shift_ptr, sb_ptr,
                        doc_ptr, out_ptr, lse_ptr,
                        sq_c, sq_b, sq_h, sq_n, sk_c, sk_b, sk_h, sk_n, sv_c, sv_b, sv_h, sv_n,
                        shk_l, shk_b, shk_h, shk_t, shv_l, shv_b, shv_h, shv_t,
                        so_c, so_b, so_h, so_n, ssh_c, ssb_c, sdoc_c, sdoc_b, sdoc_n,
                        B, H, HKV, n, CELLS, G, src0, src_step, src_top, layer0, layer_step,
                        window, qk_scale,
                        HAS_SELF: tl.constexpr, HAS_DOCS: tl.constexpr, D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        DOT_PREC: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        cell = tl.program_id(2)
        start, layer, first, groups = _cell(cell, start_ptr, CELLS, n, G, src0, src_step,
                                            src_top, layer0, layer_step)
        # int64 bases: a [L, B, H_kv, T, d] buffer can pass 2^31 elements.
        c64 = cell.to(tl.int64)
        b = (bh // H).to(tl.int64)
        h = bh % H
        hkv = (h // (H // HKV)).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        m_mask = offs_m < n
        q = tl.load(q_ptr + c64 * sq_c + b * sq_b + h * sq_h + offs_m[:, None] * sq_n
                    + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        k_own = k_ptr + c64 * sk_c + b * sk_b + hkv * sk_h
        v_own = v_ptr + c64 * sv_c + b * sv_b + hkv * sv_h
        # A finite start: a row whose first tiles are all masked gets exp2(-inf - (-1e30)) = 0
        # instead of NaN from (-inf) - (-inf).
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if HAS_SELF:
            self_bias = tl.load(sb_ptr + c64 * ssb_c).to(tl.float32) * _LOG2E
        own0 = 0
        if HAS_DOCS:
            lower, tile_lo = _row_bounds(doc_ptr + c64 * sdoc_c + b * sdoc_b, sdoc_n, offs_m,
                                         m_mask)
            own0 = _first_tile(0, tile_lo - start, BLOCK_N)
        # Own keys: j <= i, only tiles up to this query tile's last row.
        for j0 in range(own0, tl.minimum(n, (pid_m + 1) * BLOCK_M), BLOCK_N):
            offs_n = j0 + tl.arange(0, BLOCK_N)
            kv_mask = (offs_n < n)[:, None] & d_mask[None, :]
            k = _tile(k_own, offs_n, sk_n, offs_d, kv_mask)
            v = _tile(v_own, offs_n, sv_n, offs_d, kv_mask)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            if HAS_SELF:
                s += tl.where(offs_m[:, None] == offs_n[None, :], self_bias, 0.0)
            read = offs_n[None, :] <= offs_m[:, None]
            if HAS_DOCS:
                read = read & (start + offs_n[None, :] >= lower[:, None])
            s = tl.where(read, s, float("-inf"))
            acc, m_i, l_i = _online_step(acc, m_i, l_i, s, v, DOT_PREC)
        for g in range(groups):
            source = first + g * src_step
            bias = tl.load(shift_ptr + c64 * ssh_c + g * H + h) * _LOG2E
            k_base = _layer_base(hk_ptr, source, shk_l, b, shk_b, hkv, shk_h)
            v_base = _layer_base(hv_ptr, source, shv_l, b, shv_b, hkv, shv_h)
            lo = _group_lo(start, window, source, layer)
            if HAS_DOCS:
                lo = _first_tile(lo, tile_lo, BLOCK_N)
            for j0 in range(lo, start, BLOCK_N):
                offs_n = j0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < start
                kv_mask = n_mask[:, None] & d_mask[None, :]
                k = _tile(k_base, offs_n, shk_t, offs_d, kv_mask)
                v = _tile(v_base, offs_n, shv_t, offs_d, kv_mask)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale - bias
                read = n_mask[None, :]
                if HAS_DOCS:
                    read = read & (offs_n[None, :] >= lower[:, None])
                s = tl.where(read, s, float("-inf"))
                acc, m_i, l_i = _online_step(acc, m_i, l_i, s, v, DOT_PREC)
        out = acc / l_i[:, None]
        tl.store(out_ptr + c64 * so_c + b * so_b + h * so_h + offs_m[:, None] * so_n
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & d_mask[None, :])
        tl.store(lse_ptr + (c64 * B * H + bh) * n + offs_m, (m_i + tl.math.log2(l_i)) * _LN2,
                 mask=m_mask)

    @triton.jit
    def _query_tile(q_ptr, do_ptr, o_ptr, lse_ptr, b, h, m0, n, H,
                    sq_b, sq_h, sq_n, sdo_b, sdo_h, sdo_n, so_b, so_h, so_n,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """Queries, output gradient, lse (log2 units) and delta = rowsum(dO∘O) of one tile."""
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < n
        mask = m_mask[:, None] & (offs_d < D)[None, :]
        rows = offs_m[:, None]
        q = tl.load(q_ptr + b * sq_b + h * sq_h + rows * sq_n + offs_d[None, :], mask=mask,
                    other=0.0)
        do = tl.load(do_ptr + b * sdo_b + h * sdo_h + rows * sdo_n + offs_d[None, :], mask=mask,
                     other=0.0)
        o = tl.load(o_ptr + b * so_b + h * so_h + rows * so_n + offs_d[None, :], mask=mask,
                    other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        lse = tl.load(lse_ptr + (b * H + h) * n + offs_m, mask=m_mask, other=0.0) * _LOG2E
        return q, do, lse, delta, offs_m, m_mask

    @triton.jit
    def _score_grad(q, k, v, do, lse, delta, bias, valid, qk_scale, DOT_PREC: tl.constexpr):
        """P and the score gradient dS = P∘(dP - delta) of one (query, key) tile; `bias` in
        log2 units, `valid` the mask of real (query, key) pairs."""
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale + bias
        p = tl.where(valid, tl.math.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        return p, p * (dp - delta[:, None])

    @triton.jit
    def _doc_pairs(doc_b, sdoc_n, m0, n, positions, HAS_DOCS: tl.constexpr,
                   BLOCK_M: tl.constexpr):
        """For a key program: which (query row of tile m0, key at `positions`) pairs the
        document bounds let through (spec §7); without them a constant True. (No branch to
        skip a query tile: one costs the bf16 backward at width 200 its last registers, and
        spills; at c <= BLOCK_M a block is one query tile anyway.)"""
        pairs = True
        if HAS_DOCS:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            pairs = positions[None, :] >= _row_bounds(doc_b, sdoc_n, offs_m, offs_m < n)[0][:, None]
        return pairs

    @triton.jit
    def _key_program(task, bkv, q_ptr, k_ptr, v_ptr, hk_ptr, hv_ptr, do_ptr, o_ptr, lse_ptr,
                     start, shift_ptr, sb_ptr, doc_ptr, dk_ptr, dv_ptr, ghk_ptr, ghv_ptr,
                     sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                     shk_l, shk_b, shk_h, shk_t, shv_l, shv_b, shv_h, shv_t,
                     sdo_b, sdo_h, sdo_n, so_b, so_h, so_n,
                     sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n,
                     sgk_l, sgk_b, sgk_h, sgk_t, sgv_l, sgv_b, sgv_h, sgv_t, sdoc_b, sdoc_n,
                     H, HKV, n, T_TILES, groups, first, src_step, layer, window, scale, qk_scale,
                     HAS_SELF: tl.constexpr, HAS_DOCS: tl.constexpr, D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     DOT_PREC: tl.constexpr):
        """dK, dV of one key tile of one cell (pointers at the cell's): `task` < own tiles: the
        own keys' tile `task`; beyond: tile (task - own tiles) % T_TILES of group
        (task - own tiles) // T_TILES, nothing past the cell's `groups`. With HAS_DOCS, a
        history tile wholly below every query's bound is skipped (spec §7)."""
        b = (bkv // HKV).to(tl.int64)
        hkv = (bkv % HKV).to(tl.int64)
        per_kv = H // HKV
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        own_tiles = tl.cdiv(n, BLOCK_N)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        doc_b = doc_ptr + b * sdoc_b
        if task < own_tiles:
            offs_n = task * BLOCK_N + tl.arange(0, BLOCK_N)
            kv_mask = (offs_n < n)[:, None] & d_mask[None, :]
            k = _tile(k_ptr + b * sk_b + hkv * sk_h, offs_n, sk_n, offs_d, kv_mask)
            v = _tile(v_ptr + b * sv_b + hkv * sv_h, offs_n, sv_n, offs_d, kv_mask)
            if HAS_SELF:
                self_bias = tl.load(sb_ptr).to(tl.float32) * _LOG2E
            for hh in range(per_kv):
                h = hkv * per_kv + hh
                # Causal: only query tiles holding rows >= this tile's first key.
                for m0 in range((task * BLOCK_N) // BLOCK_M * BLOCK_M, n, BLOCK_M):
                    q, do, lse, delta, offs_m, m_mask = _query_tile(
                        q_ptr, do_ptr, o_ptr, lse_ptr, b, h, m0, n, H, sq_b, sq_h, sq_n,
                        sdo_b, sdo_h, sdo_n, so_b, so_h, so_n, D, BLOCK_M, BLOCK_D)
                    valid = (m_mask[:, None] & (offs_n < n)[None, :]
                             & (offs_n[None, :] <= offs_m[:, None])
                             & _doc_pairs(doc_b, sdoc_n, m0, n, start + offs_n, HAS_DOCS,
                                          BLOCK_M))
                    bias = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                    if HAS_SELF:
                        bias = tl.where(offs_m[:, None] == offs_n[None, :], self_bias, 0.0)
                    p, ds = _score_grad(q, k, v, do, lse, delta, bias, valid, qk_scale,
                                        DOT_PREC)
                    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
                    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PREC)
            tl.store(dk_ptr + b * sdk_b + hkv * sdk_h + offs_n[:, None] * sdk_n + offs_d[None, :],
                     (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(dv_ptr + b * sdv_b + hkv * sdv_h + offs_n[:, None] * sdv_n + offs_d[None, :],
                     dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)
        else:
            g = (task - own_tiles) // T_TILES
            live = g < groups
            # A group past the cell's reads nothing: a valid layer for the (masked) addresses.
            source = tl.where(live, first + g * src_step, 0)
            row0 = (_group_lo(start, window, source, layer)
                    + (task - own_tiles) % T_TILES * BLOCK_N)
            end = tl.where(live, start, 0)
            if HAS_DOCS:
                # A tile wholly below every query's bound is neither read nor written: its
                # gradient rows get nothing (the block's smallest bound is its first row's:
                # documents are contiguous, spec §7).
                end = tl.where(row0 + BLOCK_N <= tl.load(doc_b), 0, end)
            offs_n = row0 + tl.arange(0, BLOCK_N)
            kv_mask = (offs_n < end)[:, None] & d_mask[None, :]
            k = _tile(_layer_base(hk_ptr, source, shk_l, b, shk_b, hkv, shk_h), offs_n, shk_t,
                      offs_d, kv_mask)
            v = _tile(_layer_base(hv_ptr, source, shv_l, b, shv_b, hkv, shv_h), offs_n, shv_t,
                      offs_d, kv_mask)
            # A tile past the valid rows has nothing to do: no query loop, masked stores.
            m_end = tl.where(row0 < end, n, 0)
            for hh in range(per_kv):
                h = hkv * per_kv + hh
                bias = -tl.load(shift_ptr + g * H + h) * _LOG2E
                for m0 in range(0, m_end, BLOCK_M):
                    q, do, lse, delta, offs_m, m_mask = _query_tile(
                        q_ptr, do_ptr, o_ptr, lse_ptr, b, h, m0, n, H, sq_b, sq_h, sq_n,
                        sdo_b, sdo_h, sdo_n, so_b, so_h, so_n, D, BLOCK_M, BLOCK_D)
                    valid = (m_mask[:, None] & (offs_n < start)[None, :]
                             & _doc_pairs(doc_b, sdoc_n, m0, n, offs_n, HAS_DOCS, BLOCK_M))
                    p, ds = _score_grad(q, k, v, do, lse, delta, bias, valid, qk_scale,
                                        DOT_PREC)
                    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
                    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PREC)
            # This program is the only writer of these rows: a plain read-add-write.
            gk = (ghk_ptr + source.to(tl.int64) * sgk_l + b * sgk_b + hkv * sgk_h
                  + offs_n[:, None] * sgk_t + offs_d[None, :])
            gv = (ghv_ptr + source.to(tl.int64) * sgv_l + b * sgv_b + hkv * sgv_h
                  + offs_n[:, None] * sgv_t + offs_d[None, :])
            tl.store(gk, tl.load(gk, mask=kv_mask, other=0.0) + dk * scale, mask=kv_mask)
            tl.store(gv, tl.load(gv, mask=kv_mask, other=0.0) + dv, mask=kv_mask)

    @triton.jit
    def _query_program(m_tile, bh, q_ptr, k_ptr, v_ptr, hk_ptr, hv_ptr, do_ptr, o_ptr, lse_ptr,
                       start, shift_ptr, sb_ptr, doc_ptr, dq_ptr, rows_ptr, diag_ptr, rows_t,
                       sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                       shk_l, shk_b, shk_h, shk_t, shv_l, shv_b, shv_h, shv_t,
                       sdo_b, sdo_h, sdo_n, so_b, so_h, so_n, sdq_b, sdq_h, sdq_n,
                       sdoc_b, sdoc_n,
                       B, H, HKV, n, G, groups, first, src_step, layer, window, scale, qk_scale,
                       HAS_SELF: tl.constexpr, ROWS_AT_START: tl.constexpr,
                       HAS_DOCS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
        """dQ of one query tile of one cell (pointers at the cell's) over every key, and its
        rows' score-gradient sums: per group (`rows [G, B, H, rows_t]`; zeros past the cell's
        `groups`) and on the diagonal (`diag [B, H, rows_t]`), at the query's index, or with
        ROWS_AT_START at its position (`start` + index: a pass's buffers)."""
        b = (bh // H).to(tl.int64)
        h = bh % H
        hkv = (h // (H // HKV)).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        m0 = m_tile * BLOCK_M
        q, do, lse, delta, offs_m, m_mask = _query_tile(
            q_ptr, do_ptr, o_ptr, lse_ptr, b, h, m0, n, H, sq_b, sq_h, sq_n,
            sdo_b, sdo_h, sdo_n, so_b, so_h, so_n, D, BLOCK_M, BLOCK_D)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        row0 = start if ROWS_AT_START else 0
        if HAS_SELF:
            self_bias = tl.load(sb_ptr).to(tl.float32) * _LOG2E
            diag = tl.zeros([BLOCK_M], tl.float32)
        own0 = 0
        if HAS_DOCS:
            lower, tile_lo = _row_bounds(doc_ptr + b * sdoc_b, sdoc_n, offs_m, m_mask)
            own0 = _first_tile(0, tile_lo - start, BLOCK_N)
        for j0 in range(own0, tl.minimum(n, m0 + BLOCK_M), BLOCK_N):
            offs_n = j0 + tl.arange(0, BLOCK_N)
            kv_mask = (offs_n < n)[:, None] & d_mask[None, :]
            k = _tile(k_ptr + b * sk_b + hkv * sk_h, offs_n, sk_n, offs_d, kv_mask)
            v = _tile(v_ptr + b * sv_b + hkv * sv_h, offs_n, sv_n, offs_d, kv_mask)
            valid = m_mask[:, None] & (offs_n < n)[None, :] & (offs_n[None, :] <= offs_m[:, None])
            if HAS_DOCS:
                valid = valid & (start + offs_n[None, :] >= lower[:, None])
            on_diag = offs_m[:, None] == offs_n[None, :]
            bias = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            if HAS_SELF:
                bias = tl.where(on_diag, self_bias, 0.0)
            p, ds = _score_grad(q, k, v, do, lse, delta, bias, valid, qk_scale, DOT_PREC)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
            if HAS_SELF:
                diag += tl.sum(tl.where(on_diag, ds, 0.0), 1)
        for g in range(G):
            live = g < groups
            source = tl.where(live, first + g * src_step, 0)
            bias = -tl.load(shift_ptr + g * H + h) * _LOG2E
            k_base = _layer_base(hk_ptr, source, shk_l, b, shk_b, hkv, shk_h)
            v_base = _layer_base(hv_ptr, source, shv_l, b, shv_b, hkv, shv_h)
            row_sum = tl.zeros([BLOCK_M], tl.float32)
            lo = _group_lo(start, window, source, layer)
            if HAS_DOCS:
                lo = _first_tile(lo, tile_lo, BLOCK_N)
            # Past the cell's groups: no rows, a zero sum.
            for j0 in range(lo, tl.where(live, start, 0), BLOCK_N):
                offs_n = j0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < start
                kv_mask = n_mask[:, None] & d_mask[None, :]
                k = _tile(k_base, offs_n, shk_t, offs_d, kv_mask)
                v = _tile(v_base, offs_n, shv_t, offs_d, kv_mask)
                valid = m_mask[:, None] & n_mask[None, :]
                if HAS_DOCS:
                    valid = valid & (offs_n[None, :] >= lower[:, None])
                p, ds = _score_grad(q, k, v, do, lse, delta, bias, valid, qk_scale, DOT_PREC)
                dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
                row_sum += tl.sum(ds, 1)
            tl.store(rows_ptr + ((g * B + b) * H + h) * rows_t + row0 + offs_m, row_sum,
                     mask=m_mask)
        tl.store(dq_ptr + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_n + offs_d[None, :],
                 (dq * scale).to(dq_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
        if HAS_SELF:
            tl.store(diag_ptr + (b * H + h) * rows_t + row0 + offs_m, diag, mask=m_mask)

    @triton.jit(do_not_specialize=["n", "CELLS", "G", "T_TILES", "src0", "src_step", "src_top",
                                   "layer0", "layer_step", "window", "ssh_c", "ssb_c", "srows_c",
                                   "sdiag_c", "sdoc_c", "sdoc_b"],
                do_not_specialize_on_alignment=["shift_ptr", "sb_ptr", "doc_ptr"])
    def _backward_kernel(q_ptr, k_ptr, v_ptr, hk_ptr, hv_ptr, do_ptr, o_ptr, lse_ptr, start_ptr,
                         shift_ptr, sb_ptr, doc_ptr, dq_ptr, dk_ptr, dv_ptr, ghk_ptr, ghv_ptr,
                         rows_ptr, diag_ptr, rows_t,
                         sq_c, sq_b, sq_h, sq_n, sk_c, sk_b, sk_h, sk_n, sv_c, sv_b, sv_h, sv_n,
                         shk_l, shk_b, shk_h, shk_t, shv_l, shv_b, shv_h, shv_t,
                         sdo_c, sdo_b, sdo_h, sdo_n, so_c, so_b, so_h, so_n,
                         sdq_c, sdq_b, sdq_h, sdq_n, sdk_c, sdk_b, sdk_h, sdk_n,
                         sdv_c, sdv_b, sdv_h, sdv_n,
                         sgk_l, sgk_b, sgk_h, sgk_t, sgv_l, sgv_b, sgv_h, sgv_t,
                         ssh_c, ssb_c, srows_c, sdiag_c, sdoc_c, sdoc_b, sdoc_n,
                         B, H, HKV, n, CELLS, G, T_TILES, src0, src_step, src_top, layer0,
                         layer_step, window, scale, qk_scale,
                         HAS_SELF: tl.constexpr, ROWS_AT_START: tl.constexpr,
                         HAS_DOCS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
        # Programs [0, CELLS·key_programs): (cell, key task, b·kv head); the rest: (cell, query
        # tile, b·head).
        pid = tl.program_id(0)
        key_programs = (tl.cdiv(n, BLOCK_N) + G * T_TILES) * (B * HKV)
        query_programs = tl.cdiv(n, BLOCK_M) * (B * H)
        is_key = pid < CELLS * key_programs
        rest = tl.where(is_key, pid, pid - CELLS * key_programs)
        cell = tl.where(is_key, rest // key_programs, rest // query_programs)
        rest = tl.where(is_key, rest % key_programs, rest % query_programs)
        start, layer, first, groups = _cell(cell, start_ptr, CELLS, n, G, src0, src_step,
                                            src_top, layer0, layer_step)
        c64 = cell.to(tl.int64)
        # The cell's queries, keys, output, their gradients, lse and bias entries.
        q_c, k_c, v_c = q_ptr + c64 * sq_c, k_ptr + c64 * sk_c, v_ptr + c64 * sv_c
        do_c, o_c = do_ptr + c64 * sdo_c, o_ptr + c64 * so_c
        lse_c = lse_ptr + c64 * B * H * n
        shift_c, sb_c = shift_ptr + c64 * ssh_c, sb_ptr + c64 * ssb_c
        doc_c = doc_ptr + c64 * sdoc_c
        if is_key:
            _key_program(rest // (B * HKV), rest % (B * HKV), q_c, k_c, v_c, hk_ptr, hv_ptr,
                         do_c, o_c, lse_c, start, shift_c, sb_c, doc_c, dk_ptr + c64 * sdk_c,
                         dv_ptr + c64 * sdv_c, ghk_ptr, ghv_ptr,
                         sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                         shk_l, shk_b, shk_h, shk_t, shv_l, shv_b, shv_h, shv_t,
                         sdo_b, sdo_h, sdo_n, so_b, so_h, so_n,
                         sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n,
                         sgk_l, sgk_b, sgk_h, sgk_t, sgv_l, sgv_b, sgv_h, sgv_t, sdoc_b, sdoc_n,
                         H, HKV, n, T_TILES, groups, first, src_step, layer, window, scale,
                         qk_scale, HAS_SELF, HAS_DOCS, D, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC)
        else:
            _query_program(rest // (B * H), rest % (B * H), q_c, k_c, v_c, hk_ptr, hv_ptr,
                           do_c, o_c, lse_c, start, shift_c, sb_c, doc_c, dq_ptr + c64 * sdq_c,
                           rows_ptr + c64 * srows_c, diag_ptr + c64 * sdiag_c, rows_t,
                           sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                           shk_l, shk_b, shk_h, shk_t, shv_l, shv_b, shv_h, shv_t,
                           sdo_b, sdo_h, sdo_n, so_b, so_h, so_n, sdq_b, sdq_h, sdq_n,
                           sdoc_b, sdoc_n,
                           B, H, HKV, n, G, groups, first, src_step, layer, window, scale,
                           qk_scale, HAS_SELF, ROWS_AT_START, HAS_DOCS, D, BLOCK_M, BLOCK_N,
                           BLOCK_D, DOT_PREC)


def _meta(q: Tensor, *, backward: bool) -> dict:
    """The constexpr parameters and launch options of the forward or the backward kernel."""
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    cuda = target_device_type(q.device) == "cuda"
    tiles = cuda_tiles(block_d, q.dtype, backward=backward) if cuda else INTERPRETER_TILES
    meta = dict(D=q.shape[-1], BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=block_d,
                DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32")
    if cuda:
        meta["num_warps"] = tiles.num_warps
        if tiles.num_stages is not None:
            meta["num_stages"] = tiles.num_stages
    return meta


def _bias_entries(shift: Tensor, self_bias: Tensor | None) -> tuple[Tensor, Tensor, int, int]:
    """The biases as the kernels read them: shift (float32, each cell's `[G, H]` contiguous),
    b_σ (float32 too: one compiled kernel whatever the parameters' dtype; or a stand-in the
    kernels do not read) and their cell strides."""
    shift = _per_cell(shift)
    sb = shift if self_bias is None else _per_cell(self_bias)
    return shift, sb, shift.stride(0), sb.stride(0) if sb.dim() else 0


def _documents(lower: Tensor | None, start: Tensor, q: Tensor) -> tuple[Tensor, int, int, int]:
    """The document bounds as the kernels read them (spec §7): `lower [cells, B, n]` (any
    strides: a wave's cells are one strided view of the pass's bounds) and its strides, or a
    stand-in the kernels do not read."""
    if lower is None:
        return start, 0, 0, 0
    count, batch, _, n, _ = q.shape
    if lower.shape != (count, batch, n) or lower.dtype != torch.int64:
        raise ValueError(f"block attention: document bounds must be int64 [cells, B, n] = "
                         f"[{count}, {batch}, {n}], got {lower.dtype} {tuple(lower.shape)}")
    return (lower, *lower.stride())


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, start: Tensor,
                  shift: Tensor, self_bias: Tensor | None, lower: Tensor | None,
                  sources: list[int], layers: list[int], top: int, window: int,
                  scale: float) -> tuple[Tensor, Tensor]:
    cells = Cells.of(sources, layers, top)
    _check(q, k, v, hist_k, hist_v, shift, self_bias, cells)
    q, k, v = row_major(q), row_major(k), row_major(v)
    if cells.groups:
        hist_k, hist_v = row_major(hist_k), row_major(hist_v)
    count, batch, heads, n, width = q.shape
    out, lse = empty_outputs(q)
    shift, sb, s_shift, s_sb = _bias_entries(shift, self_bias)
    docs = _documents(lower, start, q)
    meta = _meta(q, backward=False)
    grid = (triton.cdiv(n, meta["BLOCK_M"]), batch * heads, count)
    launch(_forward_kernel, grid, q, k, v, hist_k, hist_v, start, shift, sb, docs[0], out, lse,
           *q.stride()[:4], *k.stride()[:4], *v.stride()[:4],
           *_hist_strides(hist_k, cells.groups, width),
           *_hist_strides(hist_v, cells.groups, width),
           *out.stride()[:4], s_shift, s_sb, *docs[1:],
           batch, heads, k.shape[2], n, *cells.args(), window, scale * LOG2E,
           HAS_SELF=self_bias is not None, HAS_DOCS=lower is not None, **meta)
    return out, lse


def _backward_impl(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor,
                   hist_v: Tensor, out: Tensor, lse: Tensor, start: Tensor, shift: Tensor,
                   self_bias: Tensor | None, lower: Tensor | None, grad_hist_k: Tensor,
                   grad_hist_v: Tensor, sources: list[int], layers: list[int], top: int,
                   window: int, scale: float, shift_rows: Tensor | None = None,
                   diag_rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    cells = Cells.of(sources, layers, top)
    groups = cells.groups
    _check(q, k, v, hist_k, hist_v, shift, self_bias, cells)
    if groups and (grad_hist_k.shape != hist_k.shape or grad_hist_v.shape != hist_k.shape
                   or grad_hist_k.stride(-1) != 1 or grad_hist_v.stride(-1) != 1):
        raise ValueError(f"block attention: gradient buffers must be shaped like the history "
                         f"{tuple(hist_k.shape)} with contiguous rows (got "
                         f"{tuple(grad_hist_k.shape)}, {tuple(grad_hist_v.shape)})")
    # The kernels' products take one dtype (autograd hands the gradient in out's, q's, anyway).
    grad = row_major(grad.to(q.dtype))
    q, k, v, out = row_major(q), row_major(k), row_major(v), row_major(out)
    if groups:
        hist_k, hist_v = row_major(hist_k), row_major(hist_v)
    lse = lse.contiguous()
    count, batch, heads, n, width = q.shape
    dq, dk, dv = gradient_like(q), gradient_like(k), gradient_like(v)
    # Per-row partial sums of the score gradient, reduced below in a fixed order, or left in
    # the pass's buffers (`shift_rows [cells, G, B, H, T]`, `diag_rows [cells, B, H, T]`, each
    # cell's entries contiguous) at the block's positions, for the pass to reduce once.
    in_pass = shift_rows is not None
    if in_pass:
        rows, diag, rows_t = shift_rows, diag_rows, shift_rows.shape[-1]
        if rows.shape[0] != count or rows.shape[1] < groups \
                or rows.shape[2:4] != (batch, heads) or not rows[:1].is_contiguous() \
                or diag.shape[:3] != (count, batch, heads) or not diag[:1].is_contiguous():
            raise ValueError(f"block attention: bias row buffers must be [cells, G, B, H, T] "
                             f"and [cells, B, H, T] (got {tuple(rows.shape)}, "
                             f"{tuple(diag.shape)})")
    else:
        # Groups past G (a wave's stack is as wide as the widest layer's) get zeros.
        new = lse.new_zeros if shift.shape[1] > groups else lse.new_empty
        rows, rows_t = new(count, shift.shape[1], batch, heads, n), n
        diag = (lse.new_empty(count, batch, heads, n) if self_bias is not None
                else lse.new_empty(count, 0))
    shift, sb, s_shift, s_sb = _bias_entries(shift, self_bias)
    docs = _documents(lower, start, q)
    meta = _meta(q, backward=True)
    t_tiles = triton.cdiv(hist_k.shape[3], meta["BLOCK_N"]) if groups else 0
    key_programs = (triton.cdiv(n, meta["BLOCK_N"]) + groups * t_tiles) * batch * k.shape[2]
    grid = (count * (key_programs + triton.cdiv(n, meta["BLOCK_M"]) * batch * heads),)
    launch(_backward_kernel, grid, q, k, v, hist_k, hist_v, grad, out, lse, start, shift, sb,
           docs[0], dq, dk, dv, grad_hist_k, grad_hist_v, rows, diag, rows_t,
           *q.stride()[:4], *k.stride()[:4], *v.stride()[:4],
           *_hist_strides(hist_k, groups, width), *_hist_strides(hist_v, groups, width),
           *grad.stride()[:4], *out.stride()[:4], *dq.stride()[:4], *dk.stride()[:4],
           *dv.stride()[:4], *_hist_strides(grad_hist_k, groups, width),
           *_hist_strides(grad_hist_v, groups, width), s_shift, s_sb, rows.stride(0), diag.stride(0),
           *docs[1:], batch, heads, k.shape[2], n, count, groups, t_tiles, *cells.args()[2:],
           window, scale, scale * LOG2E, HAS_SELF=self_bias is not None, ROWS_AT_START=in_pass,
           HAS_DOCS=lower is not None, **meta)
    if in_pass:
        return dq, dk, dv, lse.new_empty(0), lse.new_empty(0)
    # The shift is subtracted from the scores.
    d_shift = -rows.sum((2, 4))
    d_self_bias = diag.sum((1, 2, 3)) if self_bias is not None else diag
    return dq, dk, dv, d_shift, d_self_bias


# ---- the "triton" implementation of megabeta::history_attention ------------------------------
# Registered only with triton: without it `available()` is False and nothing calls it.
if triton is not None:
    history_attention.register("triton", forward=_forward_impl, backward=_backward_impl)


def forward(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, start: Tensor,
            shift: Tensor, self_bias: Tensor | None = None, *, sources: list[int], layer: int,
            window: int, scale: float, lower: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of one block's queries at `layer` over its own keys and its finished groups
    (one launch; not differentiable: see `block_attention`).

    `q [B, H, n, d]` (any strides, contiguous last dimension); `k, v [B, H_kv, n, d]` the
    block's construction keys/values (query i sees own keys j <= i; head h reads kv head
    h // (H / H_kv)); `hist_k, hist_v [L, B, H_kv, T, d]` the history buffers, of which group g
    reads rows [lo_g, start) of layer `sources[g]` (lo_g = max(0, start - window) for a source
    deeper than `layer` when window > 0, else 0; not read at all when `sources` is empty);
    `start` a one-element (or 0-d) int tensor on q's device (the block's first position, read
    by the kernels: no shape depends on it); `shift [G, H]` subtracted from group g's scores of
    head h; `self_bias [1]` or None added to the diagonal score; scores are q·k·scale; `lower
    [B, n]` int64 or None: the document bounds (spec §7), query i reads only keys at positions
    >= lower[:, i] (history row j is position j; own key j is start + j). `sources`
    must be an arithmetic progression (spec §3's M(l) always is). Returns `out [B, H, n, d]`
    in q's dtype (a transposed view of a contiguous `[B, n, H, d]`) and `lse [B, H, n]`
    float32, natural log.
    """
    out, lse = torch.ops.megabeta.history_attention_forward(
        q[None], k[None], v[None], hist_k, hist_v, start, shift[None], self_bias, one(lower),
        sources, [layer], block_top(sources, layer), window, scale, "triton")
    return out[0], lse[0]


def backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
             out: Tensor, lse: Tensor, start: Tensor, shift: Tensor, self_bias: Tensor | None,
             grad_hist_k: Tensor, grad_hist_v: Tensor, *, sources: list[int], layer: int,
             window: int, scale: float,
             lower: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `forward` (one launch, then the bias gradients' row sums reduced).

    `grad [B, H, n, d]` of `out`; `out, lse` as `forward` returned them; the rest as in
    `forward`. Returns `dq` (like q), `dk, dv` (like k, v: the own keys), `d_shift [G, H]`
    float32 and `d_self_bias` float32 (`[1]`, or empty when `self_bias` is None), and ADDS the
    groups' key/value gradients into `grad_hist_k, grad_hist_v` (float32, shaped like hist_k) at
    rows [lo_g, start) of layer `sources[g]`; nothing else of them is touched.
    """
    dq, dk, dv, d_shift, d_self_bias = torch.ops.megabeta.history_attention_backward(
        grad[None], q[None], k[None], v[None], hist_k, hist_v, out[None], lse[None], start,
        shift[None], self_bias, one(lower), grad_hist_k, grad_hist_v, sources, [layer],
        block_top(sources, layer), window, scale, None, None, "triton")
    return dq[0], dk[0], dv[0], d_shift[0], d_self_bias.reshape(-1)


def block_attention(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
                    grad_hist_k: Tensor, grad_hist_v: Tensor, start: Tensor, shift: Tensor,
                    self_bias: Tensor | None = None, *, sources: list[int], layer: int,
                    window: int, scale: float, anchor: Tensor | None = None,
                    shift_rows: Tensor | None = None, diag_rows: Tensor | None = None,
                    lower: Tensor | None = None) -> Tensor:
    """`forward`'s output `[B, H, n, d]`, differentiable w.r.t. q, k, v, shift and self_bias;
    its backward adds the history's gradients into `grad_hist_k, grad_hist_v` (as `backward`).
    `anchor`: an optional 0-d tensor taken as an input only so that autograd runs this
    backward before the anchor's producer's (it gets no gradient). The history buffers are
    held, not saved: rows >= start may be written between forward and backward; `start` and
    the other inputs must not change.

    `shift_rows [G, B, H, T]`, `diag_rows [B, H, T]` (float32; T any length covering the
    block's positions): a pass's buffers for the per-row score-gradient sums of the shift and
    the self bias. Given, backward writes this block's rows there (at positions start …) and
    returns no gradient for shift and self_bias: the pass reduces the rows of all its blocks
    once, instead of a reduction and a sum per block."""
    return history_attention.block(
        q, k, v, hist_k, hist_v, grad_hist_k, grad_hist_v, start, shift, self_bias,
        sources=sources, layer=layer, window=window, scale=scale, implementation="triton",
        anchor=anchor, shift_rows=shift_rows, diag_rows=diag_rows, lower=lower)


def wave_attention(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
                   grad_hist_k: Tensor, grad_hist_v: Tensor, start: Tensor, shift: Tensor,
                   self_bias: Tensor | None = None, *, sources: list[int], layers: list[int],
                   top: int, window: int, scale: float, anchor: Tensor | None = None,
                   shift_rows: Tensor | None = None, diag_rows: Tensor | None = None,
                   lower: Tensor | None = None) -> Tensor:
    """`block_attention` of a wave's cells in one launch each way (module doc, "Cells"):
    `q [cells, B, H, n, d]`, `k, v [cells, B, H_kv, n, d]`, the cells on consecutive blocks of
    n rows, oldest first, at `layers` (a constant step); `start` the LAST cell's first position;
    `sources` the last cell's source layers (each other cell's are those moved by its layer's
    offset, cut at `top`); `shift [cells, G', H]` (G' ≥ G; entries past a cell's groups are
    not used),
    `self_bias [cells]`; `shift_rows [cells, G, B, H, T]` and `diag_rows [cells, B, H, T]`
    (strided views of a pass's buffers will do); `lower [cells, B, n]` the cells' document
    bounds (a strided view of the pass's: cell i's rows n apart). Returns `[cells, B, H, n, d]`
    (a transposed view of a contiguous `[cells, B, n, H, d]`)."""
    return history_attention.attention(
        q, k, v, hist_k, hist_v, grad_hist_k, grad_hist_v, start, shift, self_bias,
        sources=sources, layers=layers, top=top, window=window, scale=scale,
        implementation="triton", anchor=anchor, shift_rows=shift_rows, diag_rows=diag_rows,
        lower=lower)
