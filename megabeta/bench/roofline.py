"""An analytic roofline of one beta_1.2 training step: FLOPs and HBM bytes per part.

    python -m megabeta.bench.roofline                          # t19_flash, its 16K tokens, H200
    python -m megabeta.bench.roofline --config t19_flash --device h100 --batch 2
    python -m megabeta.bench.roofline --preset beta_1.2_test --seq-len 2048 --no-sweeps
    python -m megabeta.bench.roofline --model.block_size=256 --model.num_kv_heads=2
    python -m megabeta.bench.roofline --doc-lengths 64-300      # what a document mask saves

Nothing runs on a device: every figure is counted from the shapes. The step is one forward, one
backward and the recomputation that `execution.activation_checkpoint` implies, at the
per-sequence shape of `--seq-len` tokens and `--batch` sequences on one GPU, in bf16 as in
training. Each part's time is max(FLOPs / peak, bytes / bandwidth); the step's lower bound is
the sum over parts (a part cannot hide behind another: they run as separate launches, except the
in-block and finished attention, which share one; the fully overlapped max(total compute, total
memory) is printed too). MFU ceiling = useful training FLOPs (`model/flops.py`, the MFU
convention: 3x the forward, no recomputation) / (peak x bound).

The parts and what they count:

- dense: every weight matmul of the block loop (model/geometry.py: the fused input projection
  with the previous layer's finished K/V, W_O, SwiGLU's gate+up and w2, the last layer's
  finished K/V; none for the last block, as in flops.py). The loop runs each layer once per
  block of c tokens, so each weight is read once per (block, layer, pass): HBM traffic, and at
  small c a large dense term. Forward: weight (bf16) + input + output. Backward: dX reads dY
  and the weight and writes dX; the weight gradient is one matmul per weight stack over the
  whole pass (layers.StackedWeight): its kept input and output-gradient rows concatenated
  (read + write) and read once. Not counted: elementwise kernels (norms, RoPE, SwiGLU's
  product, residual adds), per-step one-offs (embedding, zeroing the history's gradients).
- weights: autocast training as the code does it (model/pass_weights.py), once per pass: every
  float32 layer weight cast to bf16 (read 4, write 2 B), its stack's gradient written in bf16
  and added into the float32 gradient (read 2 + 4, write 4 B).
- head + loss: `model/loss.py` as written: chunks of 512 rows; per chunk the head weight is read
  by the logits' and the input gradient's matmuls, and the weight gradient is formed in bf16 and
  added into a float32 one (`LOGIT_BYTES`, `HEAD_WGRAD_BYTES`). FLOPs 3x the forward's (the head
  is never recomputed).
- attention: the Triton kernels' loops (`megabeta/kernels/triton_attention.py`), tile sizes from
  `cuda_tiles` (heads padded to block_d, a power of two >= 16, which is also what the tensor
  cores compute: executed FLOPs count whole padded tiles; useful ones are flops.py's). The
  history is split across S programs per query tile (`splits`: at least twice the device's SMs
  of programs), whose float32 partials are written and read back by the merge or reduction.
  Forward grid (query tile, b·head, split): every program reads its query tile, its own keys up
  to its last row (split 0) and every S-th tile of the rows [lo_g, start) of every group of its
  KV head: a group's rows are read once per (query tile, query head), so GQA does not reduce
  the forward's bytes. Backward, own keys per (b, kv head, key tile): the tile's K/V once, then
  for each query head of the kv head every query tile's q, dO, O and lse, dK/dV written.
  Backward, queries per (query tile, b·head, split): q, dO, O, lse once, every own and group
  K/V row, dQ and the per-row bias sums written, and the reader rows (q, dO, lse per group,
  delta) left for the history's gradients. Backward, history (`history_gradients`) per (source
  cell, b, kv head, key tile): the tile's K/V once, the reader rows of every later query that
  reads the tile (its kv head's query heads), its dK/dV written once: no float32
  read-modify-write of the history's gradient per block.
  - "in-block": the own keys' share of the kernels (queries, outputs, lse, dQ included);
  - "finished fwd" / "finished bwd": the groups' share (GQA and the deep-token window enter
    through the rows).
- document mask (`--doc-lengths`, spec §7): packed documents of the given lengths; the key
  tiles of the finished groups that the masked kernels skip (wholly below a query tile's, or
  for the history gradients the block's, smallest bound), and the bytes and FLOPs they would have
  cost (`document_saving`).
- recompute: block and wave checkpointing recompute every block's (wave's) forward once in
  backward: dense forward + both attention forwards again (not the head). None for `none`.

`--l2-reuse` assumes what programs running together share comes from L2 once: the forward's
group and own K/V once per (b, kv head) instead of per (query tile, query head); the backward's
q, dO, O, lse once per (b, head) for the own keys' programs; the query programs' K/V once per
(b, kv head). Without it every load is HBM traffic (a bound on this loop structure, pessimistic
where L2 holds a block's small tensors). The weights are HBM traffic either way (a layer's
bf16 weights, 61 MB at t19_flash, and a group's history rows outgrow a 50 MB L2).

Beside the bound: the launch term, launches (LAUNCHES_PER_CELL a cell) x an assumed cost per
launch, eager (from Python) and graphed (replays plus a gap per captured kernel); a step takes
at least the larger of the two. And the memory model's bytes (model/memory.py), with the
largest micro-batch the device holds.

Devices (`DEVICES`): bf16 dense peak (no sparsity) from megabeta.train.metrics.GPU_PEAKS, the
vendors' data sheets, and HBM bandwidth from the same sheets: H100 SXM 989 TFLOP/s, 3.35 TB/s;
H200 SXM 989 TFLOP/s, 4.8 TB/s; A100 SXM 80 GB 312 TFLOP/s, 2.039 TB/s; B200 (HGX) 2250 TFLOP/s,
8 TB/s. Peaks are not reachable: a bound, not a forecast.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Iterable

from megabeta.config import load_config
from megabeta.model.config import ConfigError, ModelConfig, count_parameters, preset_names
from megabeta.model.execution import ExecutionConfig
from megabeta.model.flops import attention_flops, dense_flops, training_flops
from megabeta.model.geometry import blocks, history_rows, matmul_shapes
from megabeta.model.memory import StepMemory, step_memory
from megabeta.model.plan import period
from megabeta.model.transformer import LOSS_CHUNK
from megabeta.train.metrics import GPU_PEAKS

PROG = "megabeta bench roofline"
DEFAULT_PRESET = "t19_flash"
DEFAULT_VOCAB = 55000
"""t19_flash's vocabulary comes from the data; the article's was about 55 K (spec §6)."""

ACT_BYTES = 2
"""bf16: activations, the weights as the matmuls read them, the history's K/V."""
STAT_BYTES = 4
"""float32 per-row statistics: lse, the bias gradients' row sums."""
"""Weight-gradient accumulators: float32 (float32 master parameters)."""
"""The history's gradient buffers: float32 today; bfloat16 as a what-if."""
LOGIT_BYTES = (2            # z = h·Wᵀ written in bf16
               + 2 + 4      # copied into the float32 softmax buffer
               + 4          # amax
               + 8 + 8      # sub_ and exp_ in place
               + 4          # sum
               + 8          # mul_ by keep / sums in place
               + 4 + 2      # copied back to bf16
               + 2 + 2)     # read by the input- and weight-gradient matmuls
"""HBM bytes per logit of `loss._chunked` under bf16 autocast (the softmax in float32)."""
HEAD_WGRAD_BYTES = 2 + 2 + 4 + 4 + 4 + 4
"""Per head parameter and chunk: `grad_w += (g.t() @ part).to(float32)`: the bf16 product
written and read, the float32 copy written, then `+=` reads both and writes."""

LAUNCHES_PER_CELL = 38
"""Kernel launches per (block, layer) cell of a training step on the GPU path under bf16
autocast, as `python -m megabeta.bench dispatch --bf16` counts them (37.25; the step's few
hundred once-per-pass launches are left out). tests/unit/bench/test_dispatch_count.py holds it
to the count."""
EAGER_LAUNCH_S = 20e-6
"""Assumed host time per launch when Python issues it (dispatch, autograd, Triton's launcher on
a GPU host; `python -m megabeta.bench host` measures this machine's)."""
GRAPHED_LAUNCH_S = 1.5e-6
"""Assumed gap per kernel inside a replayed CUDA graph."""
GRAPH_REPLAY_S = 10e-6
"""Assumed host cost of one CUDA graph replay."""
GRAPH_REPLAYS = 2
"""Replays per micro-step with `execution.cuda_graphs` (forward; backward with recomputation:
model/graphs.py)."""

PART_NAMES = ("dense", "weights", "head+loss", "in-block attn", "finished fwd",
              "finished bwd", "recompute")


@dataclass(frozen=True)
class Device:
    """Peak bf16 dense FLOP/s and HBM bandwidth of one GPU."""

    name: str
    peak_flops: float
    bandwidth: float
    """Bytes per second."""
    sms: int
    memory: float
    """Bytes of HBM."""


DEVICES: dict[str, Device] = {
    "h100": Device("H100", GPU_PEAKS["H100"][0], 3.35e12, 132, 80e9),
    "h200": Device("H200", GPU_PEAKS["H200"][0], 4.8e12, 132, 141e9),
    "a100": Device("A100", GPU_PEAKS["A100"][0], 2.039e12, 108, 80e9),
    "b200": Device("B200", GPU_PEAKS["B200"][0], 8.0e12, 148, 180e9),
}


def device_for(gpu_name: str) -> Device | None:
    """The table's device whose name `gpu_name` (torch.cuda.get_device_name) contains."""
    for device in DEVICES.values():
        if device.name in gpu_name:
            return device
    return None


@dataclass(frozen=True)
class Part:
    """One part of a step: executed FLOPs, useful FLOPs (flops.py's share) and HBM bytes."""

    name: str
    flops: float
    useful: float
    bytes: float
    compute_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound_by(self) -> str:
        if not self.flops and not self.bytes:
            return "-"
        return "memory" if self.memory_s > self.compute_s else "compute"


@dataclass(frozen=True)
class Bound:
    """The parts of one training step on one device and what they add up to."""

    parts: list[Part]
    device: Device
    useful_flops: float
    """flops.py's training FLOPs of the batch (the MFU numerator)."""
    launches: int = 0
    """Kernel launches of the step (`launches`)."""

    @property
    def eager_launch_s(self) -> float:
        """The host's share when every launch comes from Python (EAGER_LAUNCH_S each)."""
        return self.launches * EAGER_LAUNCH_S

    @property
    def graphed_launch_s(self) -> float:
        """The launch gaps of the step's CUDA graphs (GRAPH_REPLAYS replays)."""
        return GRAPH_REPLAYS * GRAPH_REPLAY_S + self.launches * GRAPHED_LAUNCH_S

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    @property
    def flops(self) -> float:
        return sum(p.flops for p in self.parts)

    @property
    def bytes(self) -> float:
        return sum(p.bytes for p in self.parts)

    @property
    def seconds(self) -> float:
        """The lower bound: each part at its own roof, parts one after another."""
        return sum(p.seconds for p in self.parts)

    @property
    def overlapped_s(self) -> float:
        """The looser bound of all compute overlapping all memory traffic."""
        return max(self.flops / self.device.peak_flops, self.bytes / self.device.bandwidth)

    @property
    def mfu_ceiling(self) -> float:
        return self.useful_flops / (self.device.peak_flops * self.seconds)


@dataclass(frozen=True)
class _Kernel:
    """What the counts need of the attention kernels: tiles and the padded head width."""

    fwd_m: int
    fwd_n: int
    bwd_m: int
    bwd_n: int
    block_d: int
    hist_m: int = 16
    """The history gradients' query tile (`triton_attention.HISTORY_BLOCK_M`, `of`)."""

    @property
    def hist_n(self) -> int:
        """Its key tile: the backward's."""
        return self.bwd_n

    @staticmethod
    def of(head_dim: int) -> "_Kernel":
        # Lazily: the kernels' module imports triton.
        import torch

        from megabeta.kernels.triton_attention import HISTORY_BLOCK_M, cuda_tiles

        block_d = max(16, 1 << (head_dim - 1).bit_length())
        fwd = cuda_tiles(block_d, torch.bfloat16, backward=False)
        bwd = cuda_tiles(block_d, torch.bfloat16, backward=True)
        return _Kernel(fwd.block_m, fwd.block_n, bwd.block_m, bwd.block_n, block_d,
                       HISTORY_BLOCK_M)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _loaded(ends: list[int], tile: int, n: int) -> int:
    """Own-key rows the query tiles load: keys [0, end) in whole tiles of `tile` rows, masked
    only at the block's n rows (the causal mask acts on scores, not on loads)."""
    return sum(min(n, _cdiv(end, tile) * tile) for end in ends)


class _Tally:
    """FLOPs and bytes added up per part."""

    def __init__(self) -> None:
        self.flops = dict.fromkeys(PART_NAMES, 0.0)
        self.bytes = dict.fromkeys(PART_NAMES, 0.0)

    def add(self, part: str, flops: float = 0.0, nbytes: float = 0.0) -> None:
        self.flops[part] += flops
        self.bytes[part] += nbytes


def _splits(programs: int, tiles: int, device: Device) -> int:
    """The kernels' split of the history across programs (`triton_attention.splits`)."""
    return max(1, min(tiles, _cdiv(2 * device.sms, max(programs, 1))))


def _attention(tally: _Tally, config: ModelConfig, kernel: _Kernel, start: int, n: int,
               rows: list[int], batch: int, cells: int, device: Device, l2_reuse: bool,
               recompute: bool) -> None:
    """One (block, layer)'s attention: forward, backward and, with `recompute`, the forward
    again. The block at `start` of `n` query rows, `rows[g]` history rows of group g (the
    last before `start`), `cells`: the cells a launch holds (the wave's). Per b, the counts
    follow the kernels' programs (module doc)."""
    heads, kv, bd = config.num_heads, config.num_kv_heads, kernel.block_d
    per_kv = heads // kv
    row = config.head_dim * ACT_BYTES            # one K, V, q, dO or O row
    q_side = 3 * row + STAT_BYTES                # q, dO, O and lse of one query row
    reader = 2 * row + 2 * STAT_BYTES            # q, dO, its group's lse and delta
    history = sum(rows)
    groups = len(rows)

    # Forward: programs (query tile of fwd_m rows, head, split). Each reads its tile's queries,
    # the own keys up to its last row (split 0) and every S-th tile of every group; with S > 1
    # the partial outputs, maxima and sums go through float32 buffers to the merge.
    fm, fn = kernel.fwd_m, kernel.fwd_n
    tiles = _cdiv(n, fm)
    ends = [min(n, (i + 1) * fm) for i in range(tiles)]
    own_kv = kv * n if l2_reuse else heads * _loaded(ends, fn, n)
    own_bytes = heads * n * (2 * row + STAT_BYTES) + own_kv * 2 * row
    own_flops = heads * sum(_cdiv(end, fn) for end in ends) * 4 * fm * fn * bd
    key_tiles = sum(_cdiv(r, fn) for r in rows)
    split = _splits(tiles * batch * heads * cells, key_tiles, device)
    partials = (2 * split * heads * n * (config.head_dim * 4 + 2 * STAT_BYTES)
                if split > 1 else 0)
    group_bytes = (kv if l2_reuse else heads * tiles) * history * 2 * row + partials
    group_flops = heads * tiles * key_tiles * 4 * fm * fn * bd
    tally.add("in-block attn", batch * own_flops, batch * own_bytes)
    tally.add("finished fwd", batch * group_flops, batch * group_bytes)
    if recompute:
        tally.add("recompute", batch * (own_flops + group_flops),
                  batch * (own_bytes + group_bytes))

    # Backward, own keys (kv head, key tile of bwd_n rows): K/V of the tile once; for each of
    # the kv head's query heads, the query tiles' q, dO, O, lse again (with l2_reuse once per
    # head for the whole launch: `shared`); dK/dV written.
    bm, bn = kernel.bwd_m, kernel.bwd_n
    key_tile_flops = 8 * bm * bn * bd            # S, dP, dV += Pᵀ·dO, dK += dSᵀ·Q
    query_tile_flops = 6 * bm * bn * bd          # S, dP, dQ += dS·K
    own_q_rows = [n - t * bn // bm * bm for t in range(_cdiv(n, bn))]
    key_own_bytes = kv * (4 * n * row + (0 if l2_reuse else per_kv * sum(own_q_rows) * q_side))
    key_own_flops = heads * sum(_cdiv(r, bm) for r in own_q_rows) * key_tile_flops
    shared = heads * n * q_side if l2_reuse else 0

    # Backward, queries (query tile of bwd_m rows, head, split): q, dO, O, lse once; every own
    # and group K/V row (with l2_reuse once per kv head); dQ, b_σ's and each group's row sums
    # (through float32 partials with S > 1); split 0 writes the reader rows (q, dO, lse, delta).
    tiles = _cdiv(n, bm)
    ends = [min(n, i * bm + bm) for i in range(tiles)]
    own_kv = kv * n if l2_reuse else heads * _loaded(ends, bn, n)
    query_own_bytes = (own_kv * 2 * row + heads * n * (row + STAT_BYTES * config.self_slot)
                       + (0 if l2_reuse else heads * n * q_side))
    query_own_flops = heads * sum(_cdiv(end, bn) for end in ends) * query_tile_flops
    group_tiles = sum(_cdiv(r, bn) for r in rows)
    split = _splits(tiles * batch * heads * cells, group_tiles, device)
    partials = (2 * split * heads * n * 4 * (config.head_dim + groups + 1) if split > 1 else 0)
    writes = STAT_BYTES * groups + 2 * row + STAT_BYTES * (groups + 1)  # row sums, reader row
    query_group_bytes = ((kv if l2_reuse else heads * tiles) * history * 2 * row
                         + heads * n * writes + partials)
    query_group_flops = heads * tiles * group_tiles * query_tile_flops

    # Backward, history (`history_gradients`): each history key tile (hist_n rows, from each
    # source block's first row) reads every later query row that reads it from the reader
    # rows, once per tile; its K/V once and its dK/dV written once are counted per row in
    # `_history_rows`.
    hn = kernel.hist_n
    hist_tiles = sum(_cdiv(start, hn) - (start - r) // hn for r in rows if r)
    history_bytes = heads * hist_tiles * n * reader
    history_flops = heads * hist_tiles * _cdiv(n, kernel.hist_m) * 8 * kernel.hist_m \
        * kernel.hist_n * bd

    tally.add("in-block attn", batch * (key_own_flops + query_own_flops),
              batch * (key_own_bytes + query_own_bytes + shared))
    tally.add("finished bwd", batch * (query_group_flops + history_flops),
              batch * (query_group_bytes + history_bytes))


def _history_rows(tally: _Tally, config: ModelConfig, kernel: _Kernel, rows: int, batch: int,
                  cells: int, seq_len: int, device: Device) -> None:
    """The history gradients' per-row traffic of `rows` published rows of one unit of `cells`
    published cells: each row's K/V read and its dK/dV written once, through float32 split
    partials where the kernel splits the later queries."""
    kv, width = config.num_kv_heads, config.head_dim
    programs = cells * batch * kv * _cdiv(config.block_size, kernel.hist_n)
    split = _splits(programs, _cdiv(seq_len, kernel.hist_m), device)
    per_row = kv * 2 * width * (2 * ACT_BYTES + (2 * split * 4 if split > 1 else 0))
    tally.add("finished bwd", 0, batch * rows * per_row)


def skipped_tiles(lo: int, start: int, bound: int, tile: int) -> int:
    """Key tiles of history rows [lo, start), cut from `lo` in tiles of `tile` rows, that lie
    wholly below a document bound `bound`: what the masked kernels skip (spec §7)."""
    if start <= lo:
        return 0
    return min(max(bound - lo, 0) // tile, _cdiv(start - lo, tile))


@dataclass(frozen=True)
class MaskSaving:
    """The finished groups' attention of one step (forward, recomputed forward, backward) with
    and without a document mask: history key tiles visited, and HBM bytes and FLOPs."""

    tiles: int
    tiles_skipped: int
    bytes: float
    bytes_saved: float
    flops: float
    flops_saved: float


def document_saving(config: ModelConfig, kernel: _Kernel, starts: list[int],
                    recompute: bool) -> MaskSaving:
    """What the document mask saves in one sample's finished-group attention, given each
    position's document start `starts` (spec §7; its length is the sequence's). Per (block,
    layer, group): the forward's and the backward query programs' query tiles skip the history
    tiles below their smallest bound (the tile's first row's: starts are non-decreasing), the
    history gradients' programs skip the block's queries for the key tiles below the block's
    first row's bound: no K/V load and no products, and for the history's gradients no reader
    rows read. Counted as `_attention` counts them (no L2 reuse), in whole tiles."""
    c, n = config.block_size, config.block_size
    heads, bd = config.num_heads, kernel.block_d
    row = config.head_dim * ACT_BYTES
    passes = 2 if recompute else 1
    # Per skipped tile: (bytes, FLOPs) of a forward query tile, a key program, a query program.
    fwd = (passes * heads * kernel.fwd_n * 2 * row,
           passes * heads * 4 * kernel.fwd_m * kernel.fwd_n * bd)
    key = (heads * n * (2 * row + 2 * STAT_BYTES),
           heads * _cdiv(n, kernel.hist_m) * 8 * kernel.hist_m * kernel.hist_n * bd)
    query = (heads * kernel.bwd_n * 2 * row, heads * 6 * kernel.bwd_m * kernel.bwd_n * bd)
    tiles = skipped = 0
    total = [0.0, 0.0]
    saved = [0.0, 0.0]
    for start in range(c, len(starts), c):
        block = starts[start:start + n]
        for layer in range(config.num_layers):
            for rows in history_rows(config, layer, start):
                lo = start - rows
                kinds = [(fwd, kernel.fwd_n, block[::kernel.fwd_m]),
                         (key, kernel.hist_n, block[:1]),
                         (query, kernel.bwd_n, block[::kernel.bwd_m])]
                for cost, tile, bounds in kinds:
                    for bound in bounds:
                        all_tiles = _cdiv(rows, tile)
                        cut = skipped_tiles(lo, start, bound, tile)
                        tiles, skipped = tiles + all_tiles, skipped + cut
                        for i in (0, 1):
                            total[i] += all_tiles * cost[i]
                            saved[i] += cut * cost[i]
    return MaskSaving(tiles, skipped, total[0], saved[0], total[1], saved[1])


def document_starts(lengths: list[int], seq_len: int) -> list[int]:
    """Each position's document start when documents of `lengths` (cycled) fill `seq_len`
    tokens (the last one cut)."""
    starts: list[int] = []
    i = 0
    while len(starts) < seq_len:
        first = len(starts)
        starts += [first] * min(lengths[i % len(lengths)], seq_len - first)
        i += 1
    return starts


def parse_doc_lengths(text: str, count: int, seed: int = 0) -> list[int]:
    """`--doc-lengths`: "LO-HI" (uniform, `count` draws from a seeded generator) or a file of
    lengths, one a line."""
    import random

    if "-" in text and all(part.isdigit() for part in text.split("-", 1)):
        lo, hi = map(int, text.split("-", 1))
        if not 1 <= lo <= hi:
            raise ValueError(f"--doc-lengths {text!r}: need 1 <= LO <= HI")
        rng = random.Random(seed)
        return [rng.randint(lo, hi) for _ in range(count)]
    try:
        with open(text) as f:
            lengths = [int(line) for line in f if line.strip()]
    except (OSError, ValueError) as err:
        raise ValueError(f"--doc-lengths {text!r}: neither LO-HI nor a file of lengths, one "
                         f"a line ({err})") from err
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--doc-lengths {text!r}: lengths must be positive integers")
    return lengths


def format_saving(saving: MaskSaving, lengths: list[int]) -> str:
    """The document mask's lines of the report."""
    mean = sum(lengths) / len(lengths)
    return (f"document mask (spec §7; documents {min(lengths)}-{max(lengths)} tokens, mean "
            f"{mean:.0f}): finished-group attention skips {saving.tiles_skipped} of "
            f"{saving.tiles} key tiles ({saving.tiles_skipped / max(saving.tiles, 1):.1%}), "
            f"saving {saving.bytes_saved / 1e9:.2f} of {saving.bytes / 1e9:.2f} GB and "
            f"{saving.flops_saved / 1e12:.2f} of {saving.flops / 1e12:.2f} TFLOP per sequence "
            f"per step")


def _dense(tally: _Tally, shapes: Iterable[tuple[int, int]], rows: int, recompute: bool) -> None:
    """Bytes of one block's weight matmuls (FLOPs come from flops.py, whole-pass). Forward:
    the weight (cast once per pass) + input + output. Backward: dX reads dY and the weight and
    writes dX; the weight's gradient rows (its input and dY, kept) are concatenated once per
    pass (read + write) and read by one matmul per stack (`layers.StackedWeight.gradient`)."""
    e = ACT_BYTES
    for d_in, d_out in shapes:
        weight, io = d_in * d_out, rows * (d_in + d_out) * e
        tally.add("dense", nbytes=(weight * e + io) + (weight * e + io) + 3 * io)
        if recompute:
            tally.add("recompute", nbytes=weight * e + io)


def _weights(tally: _Tally, config: ModelConfig) -> None:
    """Once per pass (`model/pass_weights.py`): every layer weight cast from float32 to the
    matmuls' dtype (read 4 + write 2 B), its stack's gradient written in that dtype and added
    into the float32 gradient (read 2 + 4, write 4 B)."""
    params = count_parameters(config.replace(vocab_size=-1)) - config.d_model
    tally.add("weights", nbytes=params * (4 + ACT_BYTES + ACT_BYTES + ACT_BYTES + 4 + 4))


def launches(config: ModelConfig, seq_len: int) -> int:
    """Kernel launches of one step on the GPU path (LAUNCHES_PER_CELL a (block, layer) cell)."""
    return _cdiv(seq_len, config.block_size) * config.num_layers * LAUNCHES_PER_CELL


def step_bound(config: ModelConfig, execution: ExecutionConfig, seq_len: int, batch: int,
               device: Device, *, vocab_size: int | None = None,
               l2_reuse: bool = False) -> Bound:
    """The roofline of one training step (module doc) of `batch` sequences of `seq_len` tokens.

    `vocab_size`: the head's rows when the config takes its vocabulary from the data (-1)."""
    if config.arch != "beta12":
        raise ConfigError(f"model.arch = {config.arch!r}: the roofline models beta12's block "
                          "loop and attention kernels")
    vocab = config.vocab_size if config.vocab_size > 0 else vocab_size
    if not vocab or vocab < 1:
        raise ConfigError("model.vocab_size = -1: pass the vocabulary size (--vocab)")
    if seq_len < 1 or batch < 1:
        raise ConfigError(f"seq_len = {seq_len}, batch = {batch}: both must be >= 1")
    recompute = execution.activation_checkpoint != "none"
    cells = period(execution.schedule, config.num_layers, config.depth_window) \
        if execution.schedule == "wavefront" else 1
    kernel = _Kernel.of(config.head_dim)
    tally = _Tally()
    c, spans = config.block_size, blocks(config, seq_len)
    last = spans[-1][0]
    for start, n in spans:
        for layer in range(config.num_layers):
            _dense(tally, matmul_shapes(config, layer, start < last), batch * n, recompute)
            _attention(tally, config, kernel, start, n, history_rows(config, layer, start),
                       batch, cells, device, l2_reuse, recompute)
        if start < last:
            _history_rows(tally, config, kernel, config.num_layers * n, batch,
                          config.num_layers, seq_len, device)
    _weights(tally, config)

    d = config.d_model
    head_fwd = 2 * d * vocab * seq_len * batch
    tally.add("head+loss", 3 * head_fwd)
    for chunk_start in range(0, seq_len * batch, LOSS_CHUNK):
        chunk = min(LOSS_CHUNK, seq_len * batch - chunk_start)
        tally.add("head+loss", nbytes=vocab * d * (2 * ACT_BYTES + HEAD_WGRAD_BYTES)
                  + chunk * (vocab * LOGIT_BYTES + 3 * d * ACT_BYTES))

    layers_fwd = batch * dense_flops(config, seq_len, vocab) - head_fwd
    tally.add("dense", 3 * layers_fwd)
    if recompute:
        tally.add("recompute", layers_fwd)
    # flops.py counts in-block and finished keys together; the in-block share is each query's
    # own earlier keys and itself.
    attention = batch * attention_flops(config, seq_len)
    in_block = batch * 4 * config.head_dim * config.num_heads * config.num_layers * sum(
        n * (n + 1) // 2 for _, n in spans)
    useful = {"dense": 3 * layers_fwd, "weights": 0, "head+loss": 3 * head_fwd,
              "in-block attn": 3 * in_block, "finished fwd": attention - in_block,
              "finished bwd": 2 * (attention - in_block), "recompute": 0}
    parts = [Part(name, tally.flops[name], useful[name], tally.bytes[name],
                  tally.flops[name] / device.peak_flops, tally.bytes[name] / device.bandwidth)
             for name in PART_NAMES]
    return Bound(parts, device, batch * training_flops(config, seq_len, vocab),
                 launches(config, seq_len))


# ---- the command --------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(line, widths)))
                     for line in lines)


def format_bound(bound: Bound) -> str:
    """The per-part table and the bound's summary lines."""
    rows = [[p.name, f"{p.flops / 1e12:.2f}", f"{p.useful / 1e12:.2f}", f"{p.bytes / 1e9:.1f}",
             f"{p.compute_s * 1e3:.1f}", f"{p.memory_s * 1e3:.1f}", f"{p.seconds * 1e3:.1f}",
             p.bound_by] for p in bound.parts]
    rows.append(["total", f"{bound.flops / 1e12:.2f}", f"{bound.useful_flops / 1e12:.2f}",
                 f"{bound.bytes / 1e9:.1f}", f"{bound.flops / bound.device.peak_flops * 1e3:.1f}",
                 f"{bound.bytes / bound.device.bandwidth * 1e3:.1f}",
                 f"{bound.seconds * 1e3:.1f}", ""])
    table = _table(["part", "TFLOP", "useful TFLOP", "GB", "compute ms", "memory ms", "time ms",
                    "bound by"], rows)
    return (f"{table}\n"
            f"bound: {bound.seconds:.3f} s/step (sum of the parts' max(compute, memory)); "
            f"fully overlapped {bound.overlapped_s:.3f} s\n"
            f"MFU ceiling: {bound.mfu_ceiling:.1%} ({bound.useful_flops / 1e12:.2f} useful "
            f"TFLOP / ({bound.device.peak_flops / 1e12:.0f} TFLOP/s x {bound.seconds:.3f} s))\n"
            f"launch term: {bound.launches} launches ({LAUNCHES_PER_CELL} a cell): eager "
            f"{bound.eager_launch_s:.3f} s ({EAGER_LAUNCH_S * 1e6:.0f} us a launch from Python, "
            f"assumed), graphed {bound.graphed_launch_s:.3f} s ({GRAPH_REPLAYS} replays of "
            f"{GRAPH_REPLAY_S * 1e6:.0f} us and {GRAPHED_LAUNCH_S * 1e6:.1f} us a captured "
            f"kernel, assumed); the step cannot beat max(bound, launch term)")


def format_memory(memory: StepMemory, batch: int, device: Device) -> str:
    """The memory model's lines (model/memory.py)."""
    gib = 2**30
    parts = ", ".join(f"{name} {size / gib:.2f}" for name, size in memory.per_sequence.items())
    fixed = ", ".join(f"{name} {size / gib:.2f}" for name, size in memory.fixed.items())
    return (f"memory (model/memory.py): {memory.sequence_bytes / gib:.2f} GiB a sequence "
            f"({parts}); fixed {memory.fixed_bytes / gib:.2f} GiB ({fixed}); batch {batch}: "
            f"{memory.total(batch) / gib:.1f} GiB of {device.name}'s {device.memory / 1e9:.0f} "
            f"GB; the largest micro-batch that fits 85 %: {memory.largest_batch(device.memory)}")


@dataclass(frozen=True)
class Setting:
    """Everything `step_bound` takes but the device: one row of a sweep."""

    config: ModelConfig
    execution: ExecutionConfig
    seq_len: int
    batch: int
    vocab: int

    param_bytes: int = 4
    """The parameters' bytes in the step (2: FSDP's bf16 parameters)."""

    def memory(self) -> StepMemory:
        return step_memory(self.config, self.execution, self.seq_len, act_bytes=ACT_BYTES,
                           param_bytes=self.param_bytes, vocab_size=self.vocab)

    def bound(self, device: Device, l2_reuse: bool) -> Bound:
        return step_bound(self.config, self.execution, self.seq_len, self.batch, device,
                          vocab_size=self.vocab, l2_reuse=l2_reuse)


def sweeps(base: Setting) -> dict[str, list[tuple[str, Setting]]]:
    """The knobs swept around `base`: c, KV heads, deep-token window, gradient-buffer dtype."""
    config, t = base.config, base.seq_len
    heads = config.num_heads
    kv = sorted({h for h in (heads, 2, 1) if heads % h == 0}, reverse=True)
    return {
        "block_size c": [(str(c), replace(base, config=config.replace(block_size=c)))
                         for c in (32, 64, 128, 256) if c <= t],
        "num_kv_heads": [(str(h), replace(base, config=config.replace(num_kv_heads=h)))
                         for h in kv],
        "deep_token_window": [(str(w), replace(base, config=config.replace(deep_token_window=w)))
                              for w in (0, 256, 1024, 4096) if w < t],
        "micro-batch": [(str(b), replace(base, batch=b)) for b in (1, 2, 4, 8, 16)],
    }


def format_sweeps(base: Setting, device: Device) -> str:
    out = []
    for knob, settings in sweeps(base).items():
        rows = []
        for value, setting in settings:
            plain, cached = setting.bound(device, False), setting.bound(device, True)
            gib = setting.memory().total(setting.batch) / 2**30
            rows.append([value, f"{plain.bytes / 1e12:.3f}", f"{plain.flops / 1e12:.1f}",
                         f"{plain.seconds:.3f}", f"{plain.mfu_ceiling:.1%}",
                         f"{cached.bytes / 1e12:.3f}", f"{cached.seconds:.3f}",
                         f"{cached.mfu_ceiling:.1%}", f"{plain.eager_launch_s:.3f}",
                         f"{plain.graphed_launch_s:.3f}",
                         f"{gib:.1f}" + ("" if gib * 2**30 <= device.memory else " (too big)")])
        out.append(f"sweep {knob} (the rest as above)\n" + _table(
            [knob, "TB", "TFLOP", "bound s", "MFU ceil", "TB (L2)", "bound s (L2)",
             "MFU ceil (L2)", "launch eager s", "launch graphed s", "GiB"], rows))
    return "\n\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any --model.KEY=VALUE or --execution.KEY=VALUE after the options overrides the "
               "config or preset, as in training (megabeta/config.py): e.g. "
               "--model.block_size=256, --model.num_kv_heads=2, "
               "--execution.schedule=wavefront --execution.activation_checkpoint=wave.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="PATH",
                        help="a training TOML (its [model] and [execution]), or the name of a "
                             "shipped config (t19_flash)")
    source.add_argument("--preset", choices=preset_names(), metavar="NAME",
                        help=f"a model preset, run with block checkpointing (default "
                             f"{DEFAULT_PRESET}; one of {', '.join(preset_names())})")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the "
                                                    "config's max_seq_len)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per GPU (default 1)")
    parser.add_argument("--device", choices=sorted(DEVICES), default="h200",
                        help="peak bf16 FLOP/s and HBM bandwidth from this table (default h200)")
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB,
                        help=f"vocabulary when the config takes it from the data (default "
                             f"{DEFAULT_VOCAB})")
    parser.add_argument("--l2-reuse", action="store_true",
                        help="count loads that programs running together share once (module "
                             "doc); sweeps show both")
    parser.add_argument("--no-sweeps", action="store_true", help="only the per-part table")
    parser.add_argument("--doc-lengths", metavar="LO-HI|PATH",
                        help="document lengths of packed samples (spec §7): LO-HI uniform, or "
                             "a file of lengths one a line; prints what the mask saves")
    args, overrides = parser.parse_known_args(argv)
    for item in overrides:
        if not item.startswith(("--model.", "--execution.")):
            parser.error(f"unrecognized arguments: {item}")
    for flag in ("seq_len", "batch", "vocab"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be >= 1, got {value}")
    try:
        if args.config:
            run = load_config(args.config, overrides)
        else:
            run = load_config(None, [f"--model.preset={args.preset or DEFAULT_PRESET}",
                                     "--execution.activation_checkpoint=block", *overrides])
    except ConfigError as err:
        parser.error(str(err))
    if run.model.arch != "beta12":
        parser.error(f"argument {'--config' if args.config else '--preset'}: model.arch = "
                     f"{run.model.arch!r}: the roofline models beta12's block loop and kernels")
    args.model, args.execution = run.model, run.execution
    fsdp_bf16 = run.parallel.backend == "fsdp" and run.parallel.fsdp_param_dtype == "bf16"
    args.param_bytes = 2 if fsdp_bf16 else 4
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config, device = args.model, DEVICES[args.device]
    seq_len = args.seq_len or config.max_seq_len
    base = Setting(config, args.execution, seq_len, args.batch,
                   config.vocab_size if config.vocab_size > 0 else args.vocab,
                   args.param_bytes)
    bound = base.bound(device, args.l2_reuse)
    kernel = _Kernel.of(config.head_dim)
    print(f"{PROG}: d_model {config.d_model}, {config.num_layers} layers, heads "
          f"{config.num_heads} ({config.num_kv_heads} kv), head_dim {config.head_dim} (tiles "
          f"padded to {kernel.block_d}), c = {config.block_size}, k = {config.depth_window}, "
          f"s = {config.depth_stride}, w = {config.deep_token_window}, vocab {base.vocab}")
    print(f"{seq_len} tokens x batch {args.batch}, bf16, activation_checkpoint = "
          f"{args.execution.activation_checkpoint}, schedule {args.execution.schedule}; "
          f"{device.name}: {device.peak_flops / 1e12:.0f} TFLOP/s, "
          f"{device.bandwidth / 1e12:.2f} TB/s; attention tiles fwd {kernel.fwd_m}x"
          f"{kernel.fwd_n}, bwd {kernel.bwd_m}x{kernel.bwd_n}; L2 reuse "
          f"{'assumed' if args.l2_reuse else 'not assumed'}\n")
    print(format_bound(bound))
    print(format_memory(base.memory(), args.batch, device))
    if args.doc_lengths:
        try:
            lengths = parse_doc_lengths(args.doc_lengths, seq_len)
        except ValueError as err:
            raise SystemExit(f"{PROG}: {err}") from err
        saving = document_saving(config, kernel, document_starts(lengths, seq_len),
                                 args.execution.activation_checkpoint != "none")
        print("\n" + format_saving(saving, lengths))
        after = bound.bytes - args.batch * saving.bytes_saved
        flops = bound.flops - args.batch * saving.flops_saved
        print(f"the step's HBM traffic: {bound.bytes / 1e9:.1f} GB without the mask, "
              f"{after / 1e9:.1f} GB with it ({after / bound.bytes:.1%}); its FLOPs "
              f"{bound.flops / 1e12:.1f} and {flops / 1e12:.1f} TFLOP")
    if not args.no_sweeps:
        print("\n" + format_sweeps(base, device))


if __name__ == "__main__":
    main()
