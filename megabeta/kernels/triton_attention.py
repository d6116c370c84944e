"""The attention of a stack of cells over their whole key set (spec §3, §7) as Triton kernels:
the "triton" implementation of `megabeta::history_attention`
(`megabeta/kernels/history_attention.py`: the operator, its geometry `Cells` and its one
gradient registration).

A cell's queries attend in ONE softmax to their own keys (causal, b_σ on the diagonal; with a
decoding prefix query r is own key nk - n + r) and to each finished group g: rows [lo_g, start)
of source layer m_g of the history buffers `[L, B, H_kv, T, d]`, score minus `shift[g, h]`.
At c = 32 a cell has 32 queries and up to (k+1)·T history rows: a program per (query tile,
batch·head) would be 8 programs for an H200's 132 SMs at micro-batch 1, each reading the whole
history one tile after another. So the history is split across programs (split-K, as
flash-decoding does), S of them per query tile, S chosen from static shapes only (`splits`: at
least twice the SM count of programs where the history has the tiles), so one compiled kernel
and one CUDA graph serve every block:

- Forward (`_forward_kernel`, grid (query tiles, B·H, cells·S)): split s walks the own keys
  (s = 0) and every S-th key tile of the groups from tile s, keeping a running max, sum and
  unnormalised output; with S > 1 it writes them as partials and `_merge_kernel` combines the S
  partial softmaxes (max, rescaled sums) into the output and the natural-log lse. S = 1 writes
  the output at once.
- Backward, queries (`_backward_kernel`): each split forms its share of dQ and of each group's
  per-row score-gradient sums (the depth bias's gradient) and the diagonal's (b_σ's), reduced
  over the splits by `_reduce_kernel` where S > 1; in the same launch, programs of the own keys
  form their dK and dV. delta = rowsum(dO∘O) is recomputed from the saved output. The history's
  key/value gradients are NOT formed here: split 0 leaves what they need in the pass's reader
  buffers (the queries, dO, delta, lse plus each group's shift, per layer and position).
- Backward, history (`history_gradients`, once per unit of the pass, model/passes.py): when
  every reader of a unit's cells has run backward, `_history_kernel` forms each history row's
  key and value gradients ONCE over all the queries that read it (per key tile, the later
  blocks' query rows of every layer that reads that source, split across programs and reduced
  by `_history_reduce_kernel`), and stores them: no float32 read-modify-write of the history's
  gradient per query block.

Static shapes: `start` (the newest cell's first position) is a device tensor read inside the
kernels; the grids cover all T rows (tiles past `start` find nothing), so nothing a launch
sees depends on the block but the tensors' contents. History rows >= start are never loaded
unmasked (they may hold anything, NaN included). The source layers are an arithmetic
progression (M(l) of spec §3): the kernels get the first one and the step.

Head widths need not be powers of two (t19_flash: 200): tiles are padded to the next power of
two with masks. Inputs float32, bfloat16 or float16, accumulation in float32; float32 products
are exact IEEE ones (no TF32).
"""

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megabeta.kernels import history_attention
from megabeta.kernels.history_attention import Cells, empty_outputs, gradient_like, row_major
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

GPU_SMS = 132
"""The SM count `splits` assumes where there is no GPU to ask (compiling for a target, counting
launches): an H100's and H200's."""
INTERPRETER_SMS = 8
"""What `splits` targets under Triton's interpreter: enough programs that the tests' small
cases split the history (and exercise the merge), few enough to keep them quick."""


@functools.lru_cache(maxsize=None)
def cuda_tiles(block_d: int, dtype: torch.dtype, *, backward: bool) -> Tiles:
    """The tiles of the forward or the backward kernels on a CUDA GPU, for heads padded to
    `block_d` columns: the one place they are chosen. The figures behind them are ptxas's
    register and spill counts of sm_80 and sm_90 builds (`megabeta bench kernels`;
    docs/benchmarks/), not timings: the finished groups' attention at small c is bound by HBM
    bandwidth, so tiles that never spill come before the widest MMA.

    - Forward, 16-bit: 64x64 tiles on 4 warps (wgmma on sm_90) up to 128 columns; wider heads
      32x32 on 8 warps (a 64-wide key tile spills at 256 columns).
    - Backward, 16-bit: a key-side program (own keys, history rows) holds two float32
      [BLOCK_N, BLOCK_D] accumulators (dK, dV) and recomputes [BLOCK_M, BLOCK_N] scores, and
      one kernel serves the own keys and the split query tiles: 32x32 on 4 warps up to 128
      columns; wider heads 16x16 on 8 warps (32x16 spilled ~280 bytes).
    - float32 (exact IEEE products, no tensor cores): forward 32x16 on 4 warps up to 128
      columns, 16x16 on 8 warps wider. Backward 16x16 without software pipelining
      (num_stages = 1), whose prefetch buffers otherwise push ptxas to spill at 256 columns.
    """
    wide = block_d > 128
    if dtype.itemsize > 2:
        if backward:
            return Tiles(16, 16, 8 if wide else 4, 1)
        return Tiles(16, 16, 8, None) if wide else Tiles(32, 16, 4, None)
    if not backward:
        return Tiles(32, 32, 8, None) if wide else Tiles(64, 64, 4, None)
    return Tiles(16, 16, 8, None) if wide else Tiles(32, 32, 4, None)


def _cuda(device: torch.device) -> bool:
    return target_device_type(device) == "cuda"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def target_sms(device: torch.device) -> int:
    """The SMs the split of the history aims to fill on `device` (`splits`)."""
    if not _cuda(device):
        return INTERPRETER_SMS
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else
                         torch.cuda.current_device())
    return GPU_SMS


def splits(programs: int, tiles: int, sms: int) -> int:
    """How many programs share one query tile's key tiles: enough that `programs` such tiles
    make at least twice `sms` programs, at most `tiles` (each split has a tile)."""
    return max(1, min(tiles, -(-2 * sms // max(programs, 1))))


def _meta(q: Tensor, *, backward: bool) -> dict:
    """The constexpr parameters and launch options of the forward or the backward kernels."""
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    cuda = _cuda(q.device)
    tiles = cuda_tiles(block_d, q.dtype, backward=backward) if cuda else INTERPRETER_TILES
    meta = dict(D=q.shape[-1], BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=block_d,
                DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32")
    if cuda:
        meta["num_warps"] = tiles.num_warps
        if tiles.num_stages is not None:
            meta["num_stages"] = tiles.num_stages
    return meta


def _unpipelined(device: torch.device) -> dict:
    """No software pipelining (a CUDA option): the merging and reducing kernels' loops sum a
    few partial tiles, where the prefetch buffers only add registers (ptxas spilled them)."""
    return dict(num_stages=1) if _cuda(device) else {}


HISTORY_BLOCK_M = 16
"""The history gradients' query tile on a CUDA GPU (`_history_meta`)."""


def _history_meta(meta: dict, device: torch.device) -> dict:
    """The history gradients' kernel: the backward's key tiles, query tiles of 16 rows, on 4
    warps without software pipelining (a key-side program holds the dK and dV accumulators for
    its whole loop over later queries; with 8 warps ptxas capped it at 128 registers and
    spilled, with 32-row query tiles or pipelining too)."""
    if not _cuda(device):
        return meta
    return {**meta, "BLOCK_M": HISTORY_BLOCK_M, "num_warps": 4, **_unpipelined(device)}


def _reduce_warps(meta: dict, device: torch.device) -> dict:
    """8 warps for the history reduction of wide heads: two float32 [BLOCK_N, 256] sums a
    program, which spilled on 4."""
    return {"num_warps": 8} if _cuda(device) and meta["BLOCK_D"] > 128 else {}


def _small(meta: dict, device: torch.device) -> dict:
    """Launch options of the merging and reducing kernels (no MMA)."""
    keep = ("D", "BLOCK_M", "BLOCK_D")
    return {**{k: v for k, v in meta.items() if k in keep}, **_unpipelined(device)}


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
        raise ValueError(f"history attention: q, k, v and the history need one dtype, got "
                         f"{dtypes}")
    if count != cells.count:
        raise ValueError(f"history attention: {count} cells of queries for {cells.count} layers")
    if k.shape[:3] != (count, batch, k.shape[2]) or k.shape[3] < n or k.shape[4] != width \
            or v.shape != k.shape or heads % k.shape[2]:
        raise ValueError(f"history attention: k, v must be [cells, B, H_kv, nk, d] with nk >= n "
                         f"and H a multiple of H_kv (q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)})")
    if shift.dim() != 3 or shift.shape[0] != count or shift.shape[1] < groups \
            or shift.shape[2] != heads:
        raise ValueError(f"history attention: shift must be [cells, G, H] = [{count}, "
                         f"{groups}, {heads}] (G or more groups), got {tuple(shift.shape)}")
    if self_bias is not None and self_bias.shape != (count,):
        raise ValueError(f"history attention: self_bias must be [cells] = [{count}], got "
                         f"{tuple(self_bias.shape)}")
    if groups:
        if hist_k.dim() != 5 or hist_k.shape[1:3] != k.shape[1:3] or hist_k.shape[4] != width \
                or hist_v.shape != hist_k.shape:
            raise ValueError(f"history attention: history buffers must be [L, B, H_kv, T, d] "
                             f"(got {tuple(hist_k.shape)}, {tuple(hist_v.shape)})")
        read = [m for i in range(count) for m in cells.sources(i)]
        if min(read, default=0) < 0 or cells.top >= hist_k.shape[0]:
            raise ValueError(f"history attention: sources {sorted(set(read))} outside the "
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
        n rows, the newest one starting at `*start_ptr`; layer and sources moving by
        `layer_step` per cell, sources cut at `src_top`."""
        start = tl.load(start_ptr).to(tl.int32) - (CELLS - 1 - cell) * n
        layer = layer0 + cell * layer_step
        first = src0 + cell * layer_step
        groups = tl.where(first > src_top, 0,
                          tl.minimum(G, (src_top - first) // src_step + 1))
        return start, layer, first, groups

    @triton.jit
    def _group_lo(start, window, source, layer):
        """First history row a group reads (`history_attention.group_rows`)."""
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

    @triton.jit
    def _query_rows(q_c, sq_b, sq_h, sq_n, b, h, offs_m, offs_d, m_mask, d_mask):
        return tl.load(q_c + b * sq_b + h * sq_h + offs_m[:, None] * sq_n + offs_d[None, :],
                       mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    # Not specialised: the runtime geometry (one compiled kernel for every block and wave), and
    # the bias entries' strides and pointers (one scalar load each: alignment buys nothing).
    @triton.jit(do_not_specialize=["n", "nk", "CELLS", "G", "src0", "src_step", "src_top",
                                   "layer0", "layer_step", "window", "ssh_c", "ssb_c", "sdoc_c",
                                   "sdoc_b", "S"],
                do_not_specialize_on_alignment=["shift_ptr", "sb_ptr", "doc_ptr"])
    def _forward_kernel(q_ptr, k_ptr, v_ptr, hk_ptr, hv_ptr, start_ptr, shift_ptr, sb_ptr,
                        doc_ptr, out_ptr, lse_ptr, part_ptr, pm_ptr, pl_ptr,
                        sq_c, sq_b, sq_h, sq_n, sk_c, sk_b, sk_h, sk_n, sv_c, sv_b, sv_h, sv_n,
                        shk_l, shk_b, shk_h, shk_t, shv_l, shv_b, shv_h, shv_t,
                        so_c, so_b, so_h, so_n, ssh_c, ssb_c, sdoc_c, sdoc_b, sdoc_n,
                        B, H, HKV, n, nk, CELLS, G, src0, src_step, src_top, layer0,
                        layer_step, window, qk_scale, S,
                        HAS_SELF: tl.constexpr, HAS_DOCS: tl.constexpr, SPLIT: tl.constexpr,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        cell = tl.program_id(2) // S
        split = tl.program_id(2) % S
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
        q = _query_rows(q_ptr + c64 * sq_c, sq_b, sq_h, sq_n, b, h, offs_m, offs_d, m_mask,
                        d_mask)
        # A finite start: a row whose tiles are all masked gets exp2(-inf - (-1e30)) = 0
        # instead of NaN from (-inf) - (-inf).
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        tile_lo = 0
        if HAS_DOCS:
            lower, tile_lo = _row_bounds(doc_ptr + c64 * sdoc_c + b * sdoc_b, sdoc_n, offs_m,
                                         m_mask)
        if split == 0:
            k_own = k_ptr + c64 * sk_c + b * sk_b + hkv * sk_h
            v_own = v_ptr + c64 * sv_c + b * sv_b + hkv * sv_h
            if HAS_SELF:
                self_bias = tl.load(sb_ptr + c64 * ssb_c).to(tl.float32) * _LOG2E
            own0 = 0
            if HAS_DOCS:
                own0 = _first_tile(0, tile_lo - start, BLOCK_N)
            # Own keys: j <= nk - n + i (query i is own key nk - n + i: a decoding prefix comes
            # first), only tiles up to this query tile's last row.
            me = offs_m + (nk - n)
            for j0 in range(own0, tl.minimum(nk, (nk - n) + (pid_m + 1) * BLOCK_M), BLOCK_N):
                offs_n = j0 + tl.arange(0, BLOCK_N)
                kv_mask = (offs_n < nk)[:, None] & d_mask[None, :]
                k = _tile(k_own, offs_n, sk_n, offs_d, kv_mask)
                v = _tile(v_own, offs_n, sv_n, offs_d, kv_mask)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
                if HAS_SELF:
                    s += tl.where(me[:, None] == offs_n[None, :], self_bias, 0.0)
                read = offs_n[None, :] <= me[:, None]
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
            for j0 in range(lo + split * BLOCK_N, start, S * BLOCK_N):
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
        if SPLIT:
            # Partials `[cells, S, B, H, n, (D)]`, contiguous: the merge combines them.
            row = ((c64 * S + split) * B * H + bh) * n + offs_m
            tl.store(part_ptr + row[:, None] * D + offs_d[None, :], acc,
                     mask=m_mask[:, None] & d_mask[None, :])
            tl.store(pm_ptr + row, m_i, mask=m_mask)
            tl.store(pl_ptr + row, l_i, mask=m_mask)
        else:
            # Rows past n read nothing (l = 0): a harmless 1, never stored.
            l_i = tl.where(m_mask, l_i, 1.0)
            out = acc / l_i[:, None]
            tl.store(out_ptr + c64 * so_c + b * so_b + h * so_h + offs_m[:, None] * so_n
                     + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & d_mask[None, :])
            tl.store(lse_ptr + (c64 * B * H + bh) * n + offs_m,
                     (m_i + tl.math.log2(l_i)) * _LN2, mask=m_mask)

    @triton.jit(do_not_specialize=["n", "S"])
    def _merge_kernel(part_ptr, pm_ptr, pl_ptr, out_ptr, lse_ptr, so_c, so_b, so_h, so_n,
                      B, H, n, S, D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_D: tl.constexpr):
        """The S partial softmaxes of one query tile combined: max, rescaled sums, output and
        lse (flash-decoding's merge)."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        c64 = tl.program_id(2).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < n
        mask = m_mask[:, None] & (offs_d < D)[None, :]
        best = tl.full([BLOCK_M], -1.0e30, tl.float32)
        for s in range(S):
            row = ((c64 * S + s) * B * H + bh) * n + offs_m
            best = tl.maximum(best, tl.load(pm_ptr + row, mask=m_mask, other=-1.0e30))
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for s in range(S):
            row = ((c64 * S + s) * B * H + bh) * n + offs_m
            weight = tl.math.exp2(tl.load(pm_ptr + row, mask=m_mask, other=-1.0e30) - best)
            total += weight * tl.load(pl_ptr + row, mask=m_mask, other=0.0)
            acc += weight[:, None] * tl.load(part_ptr + row[:, None] * D + offs_d[None, :],
                                             mask=mask, other=0.0)
        b = bh // H
        h = bh % H
        total = tl.where(m_mask, total, 1.0)  # rows past n: a harmless 1, never stored
        out = acc / total[:, None]
        tl.store(out_ptr + c64 * so_c + b * so_b + h * so_h + offs_m[:, None] * so_n
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(lse_ptr + (c64 * B * H + bh) * n + offs_m, (best + tl.math.log2(total)) * _LN2,
                 mask=m_mask)

    @triton.jit
    def _score_grad(q, k, v, do, lse, delta, bias, valid, qk_scale, DOT_PREC: tl.constexpr):
        """P and the score gradient dS = P∘(dP - delta) of one (query, key) tile; `bias` in
        log2 units, `lse` too, `valid` the mask of real (query, key) pairs."""
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale + bias
        p = tl.where(valid, tl.math.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        return p, p * (dp - delta[:, None])

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
    def _doc_pairs(doc_b, sdoc_n, m0, n, positions, HAS_DOCS: tl.constexpr,
                   BLOCK_M: tl.constexpr):
        """For a key program: which (query row of tile m0, key at `positions`) pairs the
        document bounds let through (spec §7); without them a constant True."""
        pairs = True
        if HAS_DOCS:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            pairs = positions[None, :] >= _row_bounds(doc_b, sdoc_n, offs_m,
                                                      offs_m < n)[0][:, None]
        return pairs

    @triton.jit
    def _own_key_program(task, bkv, q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, start,
                         sb_ptr, doc_ptr, dk_ptr, dv_ptr,
                         sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                         sdo_b, sdo_h, sdo_n, so_b, so_h, so_n,
                         sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n, sdoc_b, sdoc_n,
                         H, HKV, n, scale, qk_scale,
                         HAS_SELF: tl.constexpr, HAS_DOCS: tl.constexpr, D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         DOT_PREC: tl.constexpr):
        """dK, dV of one tile of a cell's own keys (pointers at the cell's) over the query
        heads that read its KV head and the queries at or after it (causal)."""
        b = (bkv // HKV).to(tl.int64)
        hkv = (bkv % HKV).to(tl.int64)
        per_kv = H // HKV
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        doc_b = doc_ptr + b * sdoc_b
        offs_n = task * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n < n)[:, None] & d_mask[None, :]
        k = _tile(k_ptr + b * sk_b + hkv * sk_h, offs_n, sk_n, offs_d, kv_mask)
        v = _tile(v_ptr + b * sv_b + hkv * sv_h, offs_n, sv_n, offs_d, kv_mask)
        if HAS_SELF:
            self_bias = tl.load(sb_ptr).to(tl.float32) * _LOG2E
        for hh in range(per_kv):
            h = hkv * per_kv + hh
            for m0 in range((task * BLOCK_N) // BLOCK_M * BLOCK_M, n, BLOCK_M):
                q, do, lse, delta, offs_m, m_mask = _query_tile(
                    q_ptr, do_ptr, o_ptr, lse_ptr, b, h, m0, n, H, sq_b, sq_h, sq_n,
                    sdo_b, sdo_h, sdo_n, so_b, so_h, so_n, D, BLOCK_M, BLOCK_D)
                valid = (m_mask[:, None] & (offs_n < n)[None, :]
                         & (offs_n[None, :] <= offs_m[:, None])
                         & _doc_pairs(doc_b, sdoc_n, m0, n, start + offs_n, HAS_DOCS, BLOCK_M))
                bias = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                if HAS_SELF:
                    bias = tl.where(offs_m[:, None] == offs_n[None, :], self_bias, 0.0)
                p, ds = _score_grad(q, k, v, do, lse, delta, bias, valid, qk_scale, DOT_PREC)
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PREC)
        tl.store(dk_ptr + b * sdk_b + hkv * sdk_h + offs_n[:, None] * sdk_n + offs_d[None, :],
                 (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dv_ptr + b * sdv_b + hkv * sdv_h + offs_n[:, None] * sdv_n + offs_d[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _query_program(m_tile, bh, split, q_ptr, k_ptr, v_ptr, hk_ptr, hv_ptr, do_ptr, o_ptr,
                       lse_ptr, start, shift_ptr, sb_ptr, doc_ptr, dq_ptr, rows_ptr, diag_ptr,
                       rows_t, qpart_ptr, rpart_ptr, c64, layer,
                       rq_ptr, rdo_ptr, rlse_ptr, rdelta_ptr,
                       sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                       shk_l, shk_b, shk_h, shk_t, shv_l, shv_b, shv_h, shv_t,
                       sdo_b, sdo_h, sdo_n, so_b, so_h, so_n, sdq_b, sdq_h, sdq_n,
                       sdoc_b, sdoc_n, srq_l, srq_b, srq_h, srq_t, srl_l, srl_g, srl_b, srl_h,
                       srd_l, srd_b, srd_h,
                       B, H, HKV, n, G, groups, first, src_step, window, scale, qk_scale, S,
                       HAS_SELF: tl.constexpr, ROWS_AT_START: tl.constexpr,
                       HAS_DOCS: tl.constexpr, SPLIT: tl.constexpr, READERS: tl.constexpr,
                       D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
        """Split `split` of one query tile of one cell (pointers at the cell's): its share of dQ
        and of the rows' score-gradient sums per group (`rows`; zeros past the cell's
        `groups`) and, for split 0, the own keys' share and the diagonal's (`diag`), at the
        query's index or with ROWS_AT_START at its position (a pass's buffers). With SPLIT the
        shares go to partial buffers that `_reduce_kernel` sums. Split 0 also leaves the
        queries, dO, delta and lse (plus each group's shift) in the pass's reader buffers
        (READERS), for `_history_kernel`."""
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
        tile_lo = 0
        if HAS_DOCS:
            lower, tile_lo = _row_bounds(doc_ptr + b * sdoc_b, sdoc_n, offs_m, m_mask)
        rmask = m_mask[:, None] & d_mask[None, :]
        if split == 0:
            own0 = 0
            if HAS_DOCS:
                own0 = _first_tile(0, tile_lo - start, BLOCK_N)
            if HAS_SELF:
                self_bias = tl.load(sb_ptr).to(tl.float32) * _LOG2E
                diag = tl.zeros([BLOCK_M], tl.float32)
            for j0 in range(own0, tl.minimum(n, m0 + BLOCK_M), BLOCK_N):
                offs_n = j0 + tl.arange(0, BLOCK_N)
                kv_mask = (offs_n < n)[:, None] & d_mask[None, :]
                k = _tile(k_ptr + b * sk_b + hkv * sk_h, offs_n, sk_n, offs_d, kv_mask)
                v = _tile(v_ptr + b * sv_b + hkv * sv_h, offs_n, sv_n, offs_d, kv_mask)
                valid = (m_mask[:, None] & (offs_n < n)[None, :]
                         & (offs_n[None, :] <= offs_m[:, None]))
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
            if HAS_SELF:
                tl.store(diag_ptr + (b * H + h) * rows_t + row0 + offs_m, diag, mask=m_mask)
            if READERS:
                at = layer.to(tl.int64)
                positions = start + offs_m
                tl.store(rq_ptr + at * srq_l + b * srq_b + h * srq_h + positions[:, None] * srq_t
                         + offs_d[None, :], q, mask=rmask)
                tl.store(rdo_ptr + at * srq_l + b * srq_b + h * srq_h
                         + positions[:, None] * srq_t + offs_d[None, :], do, mask=rmask)
                tl.store(rdelta_ptr + at * srd_l + b * srd_b + h * srd_h + positions, delta,
                         mask=m_mask)
        for g in range(G):
            live = g < groups
            source = tl.where(live, first + g * src_step, 0)
            shift = tl.load(shift_ptr + g * H + h)
            bias = -shift * _LOG2E
            if READERS:
                if (split == 0) & live:
                    # This group's share of the softmax: the merged lse plus its shift
                    # (natural log), what `_history_kernel` exponentiates against.
                    tl.store(rlse_ptr + layer.to(tl.int64) * srl_l + g * srl_g + b * srl_b
                             + h * srl_h + start + offs_m, lse * _LN2 + shift, mask=m_mask)
            k_base = _layer_base(hk_ptr, source, shk_l, b, shk_b, hkv, shk_h)
            v_base = _layer_base(hv_ptr, source, shv_l, b, shv_b, hkv, shv_h)
            row_sum = tl.zeros([BLOCK_M], tl.float32)
            lo = _group_lo(start, window, source, layer)
            if HAS_DOCS:
                lo = _first_tile(lo, tile_lo, BLOCK_N)
            # Past the cell's groups: no rows, a zero sum.
            for j0 in range(lo + split * BLOCK_N, tl.where(live, start, 0), S * BLOCK_N):
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
            if SPLIT:
                tl.store(rpart_ptr + (((c64 * S + split) * G + g) * B * H + b * H + h) * n
                         + offs_m, row_sum, mask=m_mask)
            else:
                tl.store(rows_ptr + ((g * B + b) * H + h) * rows_t + row0 + offs_m, row_sum,
                         mask=m_mask)
        if SPLIT:
            row = ((c64 * S + split) * B * H + b * H + h) * n + offs_m
            tl.store(qpart_ptr + row[:, None] * D + offs_d[None, :], dq, mask=rmask)
        else:
            tl.store(dq_ptr + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_n + offs_d[None, :],
                     (dq * scale).to(dq_ptr.dtype.element_ty), mask=rmask)

    @triton.jit(do_not_specialize=["n", "CELLS", "G", "src0", "src_step", "src_top", "layer0",
                                   "layer_step", "window", "ssh_c", "ssb_c", "srows_c",
                                   "sdiag_c", "sdoc_c", "sdoc_b", "S"],
                do_not_specialize_on_alignment=["shift_ptr", "sb_ptr", "doc_ptr"])
    def _backward_kernel(q_ptr, k_ptr, v_ptr, hk_ptr, hv_ptr, do_ptr, o_ptr, lse_ptr, start_ptr,
                         shift_ptr, sb_ptr, doc_ptr, dq_ptr, dk_ptr, dv_ptr, rows_ptr, diag_ptr,
                         rows_t, qpart_ptr, rpart_ptr, rq_ptr, rdo_ptr, rlse_ptr, rdelta_ptr,
                         sq_c, sq_b, sq_h, sq_n, sk_c, sk_b, sk_h, sk_n, sv_c, sv_b, sv_h, sv_n,
                         shk_l, shk_b, shk_h, shk_t, shv_l, shv_b, shv_h, shv_t,
                         sdo_c, sdo_b, sdo_h, sdo_n, so_c, so_b, so_h, so_n,
                         sdq_c, sdq_b, sdq_h, sdq_n, sdk_c, sdk_b, sdk_h, sdk_n,
                         sdv_c, sdv_b, sdv_h, sdv_n,
                         ssh_c, ssb_c, srows_c, sdiag_c, sdoc_c, sdoc_b, sdoc_n,
                         srq_l, srq_b, srq_h, srq_t, srl_l, srl_g, srl_b, srl_h,
                         srd_l, srd_b, srd_h,
                         B, H, HKV, n, CELLS, G, src0, src_step, src_top, layer0,
                         layer_step, window, scale, qk_scale, S,
                         HAS_SELF: tl.constexpr, ROWS_AT_START: tl.constexpr,
                         HAS_DOCS: tl.constexpr, SPLIT: tl.constexpr, READERS: tl.constexpr,
                         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
        # Programs [0, CELLS·own_programs): (cell, own key tile, b·kv head); the rest: (cell,
        # query tile, b·head, split).
        pid = tl.program_id(0)
        own_programs = tl.cdiv(n, BLOCK_N) * (B * HKV)
        query_programs = tl.cdiv(n, BLOCK_M) * (B * H) * S
        is_own = pid < CELLS * own_programs
        rest = tl.where(is_own, pid, pid - CELLS * own_programs)
        cell = tl.where(is_own, rest // own_programs, rest // query_programs)
        rest = tl.where(is_own, rest % own_programs, rest % query_programs)
        start, layer, first, groups = _cell(cell, start_ptr, CELLS, n, G, src0, src_step,
                                            src_top, layer0, layer_step)
        c64 = cell.to(tl.int64)
        q_c, k_c, v_c = q_ptr + c64 * sq_c, k_ptr + c64 * sk_c, v_ptr + c64 * sv_c
        do_c, o_c = do_ptr + c64 * sdo_c, o_ptr + c64 * so_c
        lse_c = lse_ptr + c64 * B * H * n
        sb_c = sb_ptr + c64 * ssb_c
        doc_c = doc_ptr + c64 * sdoc_c
        if is_own:
            _own_key_program(rest // (B * HKV), rest % (B * HKV), q_c, k_c, v_c, do_c, o_c,
                             lse_c, start, sb_c, doc_c, dk_ptr + c64 * sdk_c,
                             dv_ptr + c64 * sdv_c,
                             sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                             sdo_b, sdo_h, sdo_n, so_b, so_h, so_n,
                             sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n, sdoc_b, sdoc_n,
                             H, HKV, n, scale, qk_scale, HAS_SELF, HAS_DOCS, D, BLOCK_M,
                             BLOCK_N, BLOCK_D, DOT_PREC)
        else:
            per_tile = (B * H) * S
            _query_program(rest // per_tile, rest % per_tile // S, rest % S, q_c, k_c, v_c,
                           hk_ptr, hv_ptr, do_c, o_c, lse_c, start, shift_ptr + c64 * ssh_c,
                           sb_c, doc_c, dq_ptr + c64 * sdq_c, rows_ptr + c64 * srows_c,
                           diag_ptr + c64 * sdiag_c, rows_t, qpart_ptr, rpart_ptr, c64, layer,
                           rq_ptr, rdo_ptr, rlse_ptr, rdelta_ptr,
                           sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                           shk_l, shk_b, shk_h, shk_t, shv_l, shv_b, shv_h, shv_t,
                           sdo_b, sdo_h, sdo_n, so_b, so_h, so_n, sdq_b, sdq_h, sdq_n,
                           sdoc_b, sdoc_n, srq_l, srq_b, srq_h, srq_t, srl_l, srl_g, srl_b,
                           srl_h, srd_l, srd_b, srd_h,
                           B, H, HKV, n, G, groups, first, src_step, window, scale,
                           qk_scale, S, HAS_SELF, ROWS_AT_START, HAS_DOCS, SPLIT, READERS, D,
                           BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC)

    @triton.jit(do_not_specialize=["n", "G", "S", "srows_c", "rows_t", "start_ptr"])
    def _reduce_kernel(qpart_ptr, rpart_ptr, dq_ptr, rows_ptr, start_ptr, sdq_c, sdq_b, sdq_h,
                       sdq_n, srows_c, rows_t, B, H, n, G, S, CELLS, scale,
                       ROWS_AT_START: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        """The S splits' shares of dQ and of the groups' row sums, summed in split order."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        cell = tl.program_id(2)
        c64 = cell.to(tl.int64)
        b = bh // H
        h = bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < n
        mask = m_mask[:, None] & (offs_d < D)[None, :]
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for s in range(S):
            row = ((c64 * S + s) * B * H + bh) * n + offs_m
            dq += tl.load(qpart_ptr + row[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
        tl.store(dq_ptr + c64 * sdq_c + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_n
                 + offs_d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=mask)
        row0 = 0
        if ROWS_AT_START:
            row0 = tl.load(start_ptr).to(tl.int32) - (CELLS - 1 - cell) * n
        for g in range(G):
            total = tl.zeros([BLOCK_M], tl.float32)
            for s in range(S):
                total += tl.load(rpart_ptr + (((c64 * S + s) * G + g) * B * H + bh) * n + offs_m,
                                 mask=m_mask, other=0.0)
            tl.store(rows_ptr + c64 * srows_c + ((g * B + b) * H + h) * rows_t + row0 + offs_m,
                     total, mask=m_mask)

    @triton.jit
    def _published_tile(pid, c, B, HKV, start0, dstart, layer0, dlayer, BLOCK_N: tl.constexpr):
        """What program `pid` of the history's gradient kernels holds: its key tile of the
        block, its cell (block start, source layer) and its batch row and kv head."""
        key_tiles = tl.cdiv(c, BLOCK_N)
        task = pid % key_tiles
        rest = pid // key_tiles
        bkv = rest % (B * HKV)
        cell = rest // (B * HKV)
        b = (bkv // HKV).to(tl.int64)
        hkv = (bkv % HKV).to(tl.int64)
        return task, cell, b, hkv, start0 + cell * dstart, layer0 + cell * dlayer

    @triton.jit(do_not_specialize=["start0", "dstart", "layer0", "dlayer", "COUNT", "length",
                                   "c", "window", "depth", "stride", "top", "S"])
    def _history_kernel(hk_ptr, hv_ptr, gk_ptr, gv_ptr, kpart_ptr, vpart_ptr,
                        rq_ptr, rdo_ptr, rlse_ptr, rdelta_ptr, doc_ptr,
                        shk_l, shk_b, shk_h, shk_t, sgk_l, sgk_b, sgk_h, sgk_t,
                        srq_l, srq_b, srq_h, srq_t, srl_l, srl_g, srl_b, srl_h,
                        srd_l, srd_b, srd_h, sdoc_b,
                        start0, dstart, layer0, dlayer, COUNT, B, H, HKV, length, c, window,
                        depth, stride, top, scale, qk_scale, S,
                        HAS_DOCS: tl.constexpr, SPLIT: tl.constexpr, D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        DOT_PREC: tl.constexpr):
        """The key and value gradients of one tile of a unit's published rows (cell i of
        COUNT: block start start0 + i·dstart, source layer layer0 + i·dlayer), over every query
        that reads them: the rows of later blocks of each layer l whose M(l) holds the source
        (l ≤ m ≤ min(l + k, L-1), m - l a multiple of the stride), restricted to the deep-token
        window (m > l) and to each query's document (spec §3, §7). Split `S` ways over the
        query tiles (interleaved); each split's share summed by `_history_reduce_kernel`."""
        split = tl.program_id(1)
        task, cell, b, hkv, start, source = _published_tile(
            tl.program_id(0), c, B, HKV, start0, dstart, layer0, dlayer, BLOCK_N)
        per_kv = H // HKV
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        offs_n = start + task * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < start + c
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = _tile(_layer_base(hk_ptr, source, shk_l, b, shk_b, hkv, shk_h), offs_n, shk_t,
                  offs_d, kv_mask)
        v = _tile(_layer_base(hv_ptr, source, shk_l, b, shk_b, hkv, shk_h), offs_n, shk_t,
                  offs_d, kv_mask)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        last_row = start + c - 1
        for layer_ in range(tl.maximum(source - depth, 0), source + 1):
            # The layer arithmetic in int32 (an int64 division is a subroutine that spills);
            # addresses in int64 (the loop variable may be a plain int): a reader buffer can
            # pass 2^31.
            offset = source - layer_
            layer = tl.full([], 0, tl.int64) + layer_
            reads = (offset % stride == 0) & (source <= tl.minimum(layer_ + depth, top))
            deep = (window > 0) & (offset > 0)
            g = offset // stride
            # Later blocks read these rows; a deeper source's only within the window.
            q_end = tl.where(deep, tl.minimum(length, ((last_row + window) // c + 1) * c),
                             length)
            q_end = tl.where(reads, q_end, 0)
            for hh in range(per_kv):
                h = hkv * per_kv + hh
                # The (layer, head) rows' pointers in int64 once; the loop below moves them
                # by int32 offsets (int64 arithmetic in the loop made ptxas spill).
                base = layer * srq_l + b * srq_b + h * srq_h
                q_rows = rq_ptr + base
                do_rows = rdo_ptr + base
                lse_rows = rlse_ptr + (layer * srl_l + g * srl_g + b * srl_b + h * srl_h)
                delta_rows = rdelta_ptr + (layer * srd_l + b * srd_b + h * srd_h)
                for q0 in range(start + c + split * BLOCK_M, q_end, S * BLOCK_M):
                    offs_m = q0 + tl.arange(0, BLOCK_M)
                    m_mask = offs_m < q_end
                    rmask = m_mask[:, None] & d_mask[None, :]
                    at = offs_m[:, None] * srq_t + offs_d[None, :]
                    q = tl.load(q_rows + at, mask=rmask, other=0.0)
                    do = tl.load(do_rows + at, mask=rmask, other=0.0)
                    lse = tl.load(lse_rows + offs_m, mask=m_mask, other=0.0) * _LOG2E
                    delta = tl.load(delta_rows + offs_m, mask=m_mask, other=0.0)
                    valid = m_mask[:, None] & n_mask[None, :]
                    block_start = offs_m - offs_m % c
                    valid = valid & ((~deep) | (offs_n[None, :] >= block_start[:, None] - window))
                    if HAS_DOCS:
                        lower = tl.load(doc_ptr + b * sdoc_b + offs_m, mask=m_mask, other=0)
                        valid = valid & (offs_n[None, :] >= lower[:, None])
                    p, ds = _score_grad(q, k, v, do, lse, delta, 0.0, valid, qk_scale, DOT_PREC)
                    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
                    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PREC)
        if SPLIT:
            row = (((split * COUNT + cell) * B + b) * HKV + hkv) * c + (offs_n - start)
            tl.store(kpart_ptr + row[:, None] * D + offs_d[None, :], dk * scale, mask=kv_mask)
            tl.store(vpart_ptr + row[:, None] * D + offs_d[None, :], dv, mask=kv_mask)
        else:
            gk = (_layer_base(gk_ptr, source, sgk_l, b, sgk_b, hkv, sgk_h)
                  + offs_n[:, None] * sgk_t + offs_d[None, :])
            gv = (_layer_base(gv_ptr, source, sgk_l, b, sgk_b, hkv, sgk_h)
                  + offs_n[:, None] * sgk_t + offs_d[None, :])
            tl.store(gk, (dk * scale).to(gk_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(gv, dv.to(gv_ptr.dtype.element_ty), mask=kv_mask)

    @triton.jit(do_not_specialize=["start0", "dstart", "layer0", "dlayer", "COUNT", "c", "S"])
    def _history_reduce_kernel(kpart_ptr, vpart_ptr, gk_ptr, gv_ptr, sgk_l, sgk_b, sgk_h,
                               sgk_t, start0, dstart, layer0, dlayer, COUNT, B, HKV, c, S,
                               D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """The S splits' key and value gradients of one tile of published rows, summed in split
        order and stored (once) in the history's gradient buffers."""
        task, cell, b, hkv, start, source = _published_tile(
            tl.program_id(0), c, B, HKV, start0, dstart, layer0, dlayer, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        local = task * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (local < c)[:, None] & (offs_d < D)[None, :]
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        # The split buffers' rows in int32 (their index stays far below 2^31), one int64
        # product for the address: int64 arithmetic in the loop made ptxas spill.
        first = ((cell * B + b.to(tl.int32)) * HKV + hkv.to(tl.int32)) * c + local
        split_rows = COUNT * B * HKV * c
        for s in range(S):
            at = (s * split_rows + first).to(tl.int64)[:, None] * D + offs_d[None, :]
            dk += tl.load(kpart_ptr + at, mask=mask, other=0.0)
            dv += tl.load(vpart_ptr + at, mask=mask, other=0.0)
        rows = start + local
        gk = (_layer_base(gk_ptr, source, sgk_l, b, sgk_b, hkv, sgk_h) + rows[:, None] * sgk_t
              + offs_d[None, :])
        gv = (_layer_base(gv_ptr, source, sgk_l, b, sgk_b, hkv, sgk_h) + rows[:, None] * sgk_t
              + offs_d[None, :])
        tl.store(gk, dk.to(gk_ptr.dtype.element_ty), mask=mask)
        tl.store(gv, dv.to(gv_ptr.dtype.element_ty), mask=mask)


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
        raise ValueError(f"history attention: document bounds must be int64 [cells, B, n] = "
                         f"[{count}, {batch}, {n}], got {lower.dtype} {tuple(lower.shape)}")
    return (lower, *lower.stride())


def _key_tiles(hist_k: Tensor, cells: Cells, block_n: int) -> int:
    """Key tiles of the history a query tile may read (every group's rows up to T)."""
    return triton.cdiv(hist_k.shape[3], block_n) * cells.groups if cells.groups else 0


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
    q_tiles = triton.cdiv(n, meta["BLOCK_M"])
    s = splits(q_tiles * batch * heads * count, _key_tiles(hist_k, cells, meta["BLOCK_N"]),
               target_sms(q.device))
    part = pm = pl = lse
    if s > 1:
        part = q.new_empty(count, s, batch, heads, n, width, dtype=torch.float32)
        pm = q.new_empty(count, s, batch, heads, n, dtype=torch.float32)
        pl = torch.empty_like(pm)
    launch(_forward_kernel, (q_tiles, batch * heads, count * s), q, k, v, hist_k, hist_v, start,
           shift, sb, docs[0], out, lse, part, pm, pl,
           *q.stride()[:4], *k.stride()[:4], *v.stride()[:4],
           *_hist_strides(hist_k, cells.groups, width),
           *_hist_strides(hist_v, cells.groups, width),
           *out.stride()[:4], s_shift, s_sb, *docs[1:],
           batch, heads, k.shape[2], n, k.shape[3], *cells.args(), window, scale * LOG2E, s,
           HAS_SELF=self_bias is not None, HAS_DOCS=lower is not None, SPLIT=s > 1, **meta)
    if s > 1:
        launch(_merge_kernel, (q_tiles, batch * heads, count), part, pm, pl, out, lse,
               *out.stride()[:4], batch, heads, n, s, **_small(meta, q.device))
    return out, lse


def readers(history_k: Tensor, heads: int, groups: int) -> list[Tensor]:
    """The pass's reader buffers for `history_gradients`, one set per pass of a history
    `[L, B, H_kv, T, d]` read by queries of `heads` heads (in the history's dtype) and at most
    `groups` groups: queries and their output gradients `[L, B, H, T, d]`, lse plus each group's
    shift `[L, G, B, H, T]` and delta `[L, B, H, T]` (float32)."""
    layers, batch, _, length, width = history_k.shape
    q_all = history_k.new_empty(layers, batch, heads, length, width)
    return [q_all, torch.empty_like(q_all),
            history_k.new_empty(layers, max(groups, 1), batch, heads, length,
                                dtype=torch.float32),
            history_k.new_empty(layers, batch, heads, length, dtype=torch.float32)]


def _backward_impl(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor,
                   hist_v: Tensor, out: Tensor, lse: Tensor, start: Tensor, shift: Tensor,
                   self_bias: Tensor | None, lower: Tensor | None, state: list[Tensor],
                   sources: list[int], layers: list[int], top: int, window: int, scale: float,
                   shift_rows: Tensor | None = None,
                   diag_rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`state`: the pass's reader buffers (`readers`), which split 0 fills for the history's
    deferred gradients, or empty (no history gradient wanted)."""
    cells = Cells.of(sources, layers, top)
    groups = cells.groups
    _check(q, k, v, hist_k, hist_v, shift, self_bias, cells)
    if k.shape[3] != q.shape[3]:
        raise ValueError("history attention: the backward takes own keys as long as the queries "
                         "(a decoding prefix is forward only)")
    # The kernels' products take one dtype (autograd hands the gradient in out's, q's, anyway).
    grad = row_major(grad.to(q.dtype))
    q, k, v, out = row_major(q), row_major(k), row_major(v), row_major(out)
    if groups:
        hist_k, hist_v = row_major(hist_k), row_major(hist_v)
    lse = lse.contiguous()
    count, batch, heads, n, width = q.shape
    dq, dk, dv = gradient_like(q), gradient_like(k), gradient_like(v)
    # Per-row partial sums of the score gradient, reduced below, or left in the pass's buffers
    # (`shift_rows [cells, G, B, H, T]`, `diag_rows [cells, B, H, T]`, each cell's entries
    # contiguous) at the block's positions, for the pass to reduce once.
    in_pass = shift_rows is not None
    if in_pass:
        rows, diag, rows_t = shift_rows, diag_rows, shift_rows.shape[-1]
        if rows.shape[0] != count or rows.shape[1] < groups \
                or rows.shape[2:4] != (batch, heads) or not rows[:1].is_contiguous() \
                or diag.shape[:3] != (count, batch, heads) or not diag[:1].is_contiguous():
            raise ValueError(f"history attention: bias row buffers must be [cells, G, B, H, T] "
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
    q_tiles = triton.cdiv(n, meta["BLOCK_M"])
    s = splits(q_tiles * batch * heads * count, _key_tiles(hist_k, cells, meta["BLOCK_N"]),
               target_sms(q.device))
    qpart = rpart = lse
    if s > 1:
        qpart = q.new_empty(count, s, batch, heads, n, width, dtype=torch.float32)
        rpart = q.new_empty(count, s, max(groups, 1), batch, heads, n, dtype=torch.float32)
    use_readers = bool(state)
    r_q, r_do, r_lse, r_delta = state if state else (lse, lse, lse, lse)
    r_strides = (tuple(r_q.stride()[:4]) + tuple(r_lse.stride()[:4])
                 + tuple(r_delta.stride()[:3])) if state else (0,) * 11
    own_programs = triton.cdiv(n, meta["BLOCK_N"]) * batch * k.shape[2]
    grid = (count * (own_programs + q_tiles * batch * heads * s),)
    launch(_backward_kernel, grid, q, k, v, hist_k, hist_v, grad, out, lse, start, shift, sb,
           docs[0], dq, dk, dv, rows, diag, rows_t, qpart, rpart, r_q, r_do, r_lse, r_delta,
           *q.stride()[:4], *k.stride()[:4], *v.stride()[:4],
           *_hist_strides(hist_k, groups, width), *_hist_strides(hist_v, groups, width),
           *grad.stride()[:4], *out.stride()[:4], *dq.stride()[:4], *dk.stride()[:4],
           *dv.stride()[:4], s_shift, s_sb, rows.stride(0), diag.stride(0), *docs[1:],
           *r_strides, batch, heads, k.shape[2], n, count, groups, *cells.args()[2:],
           window, scale, scale * LOG2E, s, HAS_SELF=self_bias is not None,
           ROWS_AT_START=in_pass, HAS_DOCS=lower is not None, SPLIT=s > 1,
           READERS=use_readers, **meta)
    if s > 1:
        launch(_reduce_kernel, (q_tiles, batch * heads, count), qpart, rpart, dq, rows, start,
               *dq.stride()[:4], rows.stride(0), rows_t, batch, heads, n, groups, s, count,
               scale, ROWS_AT_START=in_pass, **_small(meta, q.device))
    if in_pass:
        return dq, dk, dv, lse.new_empty(0), lse.new_empty(0)
    # The shift is subtracted from the scores.
    d_shift = -rows.sum((2, 4))
    d_self_bias = diag.sum((1, 2, 3)) if self_bias is not None else diag
    return dq, dk, dv, d_shift, d_self_bias


def history_gradients(hist_k: Tensor, hist_v: Tensor, grad_k: Tensor, grad_v: Tensor,
                      state: list[Tensor], documents: Tensor | None, *, cells: list[tuple[int, int]],
                      block: int, depth: int, stride: int, window: int, scale: float) -> None:
    """Store the key and value gradients of the history rows of `cells` ((block start, source
    layer), `block` rows each: a unit's published cells, whose block starts and layers step by
    constants) in `grad_k, grad_v` (shaped like the history `[L, B, H_kv, T, d]`), from the
    reader buffers `state` (`readers`) that every later query's backward filled; `documents
    [B, T]`: each position's document start (spec §7), or None. `depth`, `stride`, `window`:
    the model's depth window k, depth stride and deep-token window."""
    if not cells:
        return
    starts = [s for s, _ in cells]
    layers = [m for _, m in cells]
    count = len(cells)
    dstart = starts[1] - starts[0] if count > 1 else 0
    dlayer = layers[1] - layers[0] if count > 1 else 0
    if any(b - a != dstart for a, b in zip(starts, starts[1:])) or \
            any(b - a != dlayer for a, b in zip(layers, layers[1:])):
        raise ValueError(f"history gradients: the cells' starts and layers must step by "
                         f"constants, got {cells}")
    r_q, r_do, r_lse, r_delta = state
    layers_total, batch, kv_heads, length, width = hist_k.shape
    heads = r_q.shape[2]
    meta = _history_meta(_meta(r_q, backward=True), hist_k.device)
    key_tiles = triton.cdiv(block, meta["BLOCK_N"])
    programs = count * batch * kv_heads * key_tiles
    query_tiles = triton.cdiv(length, meta["BLOCK_M"])
    s = splits(programs, query_tiles, target_sms(hist_k.device))
    kpart = vpart = r_delta
    if s > 1:
        kpart = hist_k.new_empty(s, count, batch, kv_heads, block, width, dtype=torch.float32)
        vpart = torch.empty_like(kpart)
    doc = documents if documents is not None else r_delta
    launch(_history_kernel, (programs, s), hist_k, hist_v, grad_k, grad_v, kpart, vpart,
           r_q, r_do, r_lse, r_delta, doc, *hist_k.stride()[:4], *grad_k.stride()[:4],
           *r_q.stride()[:4], *r_lse.stride()[:4], *r_delta.stride()[:3],
           doc.stride(0) if documents is not None else 0,
           starts[0], dstart, layers[0], dlayer, count, batch, heads, kv_heads, length, block,
           window, depth, stride, layers_total - 1, scale, scale * LOG2E, s,
           HAS_DOCS=documents is not None, SPLIT=s > 1, **meta)
    if s > 1:
        launch(_history_reduce_kernel, (programs,), kpart, vpart, grad_k, grad_v,
               *grad_k.stride()[:4], starts[0], dstart, layers[0], dlayer, count, batch,
               kv_heads, block, s, D=width, BLOCK_N=meta["BLOCK_N"], BLOCK_D=meta["BLOCK_D"],
               **_unpipelined(hist_k.device), **_reduce_warps(meta, hist_k.device))


# ---- the "triton" implementation of megabeta::history_attention ------------------------------
# Registered only with triton: without it `available()` is False and nothing calls it.
if triton is not None:
    history_attention.register("triton", forward=_forward_impl, backward=_backward_impl)


__all__ = ["GPU_SMS", "HISTORY_BLOCK_M", "Tiles", "available", "cuda_tiles", "history_gradients", "readers",
           "splits", "target_sms"]
