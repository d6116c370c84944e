"""The attention interface: what one block of queries attends to, and the protocol every
attention implementation follows.

A block of `n` consecutive queries of layer l attends, in ONE softmax (spec §3), to:

1. finished groups: per source layer m ∈ M(l), finished KVs of tokens before the block, with the
   score bias `-λ_{l,h}·(m - l)` (depth offset m - l);
2. construction KVs of earlier tokens of the same block that are not among the queries (the
   `prefix`: non-empty only when decoding continues a partly filled block);
3. construction KVs of the queries themselves: token j is an in-block key for later queries and
   the self slot (bias b_σ) for its own query.

`KeySet` carries those keys: the history either as pieces (`finished`, `prefix`) or as a
`StoredHistory` (buffers the training forward writes once per block, history.py). An
`AttentionBackend` computes the softmax; which one runs is decided once per model
(`select.select_attention`) and held by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from megabeta.model.layers import HandOut


@dataclass(frozen=True)
class KeyLayout:
    """How a backend stores keys and values: `head_dim` features, in the dtypes its kernels
    take."""

    head_dim: int
    dtypes: frozenset[torch.dtype] | None = None
    """The dtypes its history buffers can have (None: any); others are stored as float32."""

    def stored_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The history buffers' dtype for finished KVs computed in `dtype`."""
        return dtype if self.dtypes is None or dtype in self.dtypes else torch.float32


@dataclass(eq=False)
class BiasRows:
    """Per-row partial sums of one pass's bias gradients, every layer's, for kernels that write
    them per block (the `triton` backend) instead of reducing and summing per block.

    Buffers `[L, G, B, H, T]` (the depth shift's groups; G the most one layer reads) and
    `[L, B, H, T]` (the self bias's diagonal), float32, layers in REVERSE order like the
    wavefront's weight stacks (a wave's cells are one strided view, `WaveBias`), allocated by
    the first reader (`buffers`). `hand_out_stacks` makes every layer's shifts and self biases,
    stacked, tensors whose gradient, once every reader's backward has run, is the reduction of
    the rows (plus what other readers returned), one per pass.
    """

    length: int
    """T: the pass's tokens."""
    groups: list[int]
    """Per layer, how many finished groups it reads (|M(l)|)."""
    shift: Tensor | None = None
    diag: Tensor | None = None

    def buffers(self, batch: int, heads: int, like: Tensor) -> tuple[Tensor, Tensor]:
        if self.shift is None:
            # Zeros: rows of blocks whose kernels write none (no groups yet) must add nothing.
            layers = len(self.groups)
            self.shift = like.new_zeros(layers, max(self.groups), batch, heads, self.length,
                                        dtype=torch.float32)
            self.diag = like.new_zeros(layers, batch, heads, self.length, dtype=torch.float32)
        return self.shift, self.diag

    def slot(self, layer: int) -> int:
        """Layer `layer`'s index in the buffers (reverse order)."""
        return len(self.groups) - 1 - layer

    def layer_buffers(self, layer: int, batch: int, heads: int,
                      like: Tensor) -> tuple[Tensor, Tensor]:
        """Layer `layer`'s buffers `[G_l, B, H, T]` and `[B, H, T]`."""
        shift, diag = self.buffers(batch, heads, like)
        return shift[self.slot(layer), :self.groups[layer]], diag[self.slot(layer)]

    def hand_out_stacks(self, shift: Tensor, self_bias: Tensor | None
                        ) -> tuple[Tensor, Tensor | None]:
        """Every layer's shifts `[L, G, H]` and self biases `[L]`, stacked in reverse layer
        order, read through the reducing nodes (when they need gradients)."""
        return self._through(shift, "shift"), self._through(self_bias, "diag")

    def _through(self, t: Tensor | None, kind: str) -> Tensor | None:
        if t is None or not (t.requires_grad and torch.is_grad_enabled()):
            return t
        return HandOut.apply(t, _RowsReduction(self, kind, t.shape, t.dtype))


@dataclass(eq=False)
class _RowsReduction:
    """The gradient of a bias read through `BiasRows` (`layers.HandOut`'s collector): the
    reduction of its rows, once every reader's backward has run (the shift is
    subtracted from scores: minus its rows' sums over batch and position; b_σ: the diagonal's
    sum)."""

    rows: BiasRows
    kind: str
    shape: torch.Size
    dtype: torch.dtype

    def collected(self) -> Tensor | None:
        rows = self.rows
        if rows.shift is None:
            return None
        if self.kind == "shift":
            part = -rows.shift.sum((-3, -1))
        else:
            part = rows.diag.sum((-3, -2, -1))
        return part.reshape(self.shape).to(self.dtype)


@dataclass(frozen=True)
class AttentionBias:
    """The learned biases of one layer's scores (spec §3)."""

    slope: Tensor | None = None
    """λ_{l,h} per head `[H]`; None: no depth bias."""
    self_bias: Tensor | None = None
    """b_σ `[1]`; None: the self slot has no bias (and no column)."""
    group_shift: Tensor | None = None
    """`[G, H]` float32 (float64 for a float64 λ): λ_h·(m - l) per source m ∈ M(l), what the
    fused kernels subtract from each finished group's scores (built once per pass with the other
    weights, `PassBiases`); None: no groups."""
    rows: BiasRows | None = None
    """Where the fused kernels may leave the biases' gradient rows for the pass to reduce."""


NO_BIAS = AttentionBias()
"""The control arms' scores: plain causal attention."""


@dataclass(frozen=True)
class WaveBias:
    """The score biases of a wave's n cells (spec §5, model/wavefront.py), oldest cell first:
    strided views of one pass's stacks of every layer's biases (reverse layer order, as the
    wave's weights), so that a wave reads them without copying."""

    slope: Tensor | None
    """λ per cell and head `[n, H]`; None: no depth bias."""
    self_bias: Tensor | None
    """b_σ per cell `[n]`; None: no self-slot bias."""
    group_shift: Tensor
    """`[n, G, H]` float32 (float64 for a float64 λ): λ_h·(m - l) per group of each cell's
    layer (G the most groups any layer reads; entries past a cell's groups are not read)."""
    rows: BiasRows | None
    """The pass's gradient rows (None: no kernel leaves rows)."""
    cells: slice
    """The cells' entries in `rows`' buffers."""

    def per_cell(self) -> list[AttentionBias]:
        """Each cell's slope, self bias and group shifts (`[G, H]`, G the stack's: entries past
        the cell's groups unused), and the pass's gradient rows: what the backends that attend
        cell by cell read (the rows: a wave of one cell with no history, at block 0)."""
        n = self.group_shift.shape[0]
        slopes = [None] * n if self.slope is None else split_cells(self.slope)
        selfs = ([None] * n if self.self_bias is None
                 else [b[None] for b in split_cells(self.self_bias)])
        return [AttentionBias(slope, self_bias, shift, rows=self.rows)
                for slope, self_bias, shift in zip(slopes, selfs, split_cells(self.group_shift))]

    def row_buffers(self, batch: int, heads: int,
                    like: Tensor) -> tuple[Tensor, Tensor] | None:
        """The cells' gradient-row buffers `[n, G, B, H, T]` and `[n, B, H, T]`, when a pass
        collects them and gradients are wanted."""
        if self.rows is None or not torch.is_grad_enabled():
            return None
        shift, diag = self.rows.buffers(batch, heads, like)
        return shift[self.cells], diag[self.cells]


def split_cells(stack: Tensor) -> tuple[Tensor, ...]:
    """A stack's cells `[n, …]` as n views whose gradients come back as one stack (one cell's:
    a squeeze, no kernel), not as one zero-filled gradient of the stack per indexed cell."""
    return (stack.squeeze(0),) if len(stack) == 1 else stack.unbind(0)


def stack_cells(cells: list[Tensor]) -> Tensor:
    """`split_cells`'s inverse (one cell: a view)."""
    return cells[0][None] if len(cells) == 1 else torch.stack(cells)


def group_rows(window: int, layer: int, source: int, start: int) -> slice:
    """Tokens of source layer `source`'s finished group that queries of `layer` in the block at
    `start` read (spec §3): all before the block, or with deep_token_window w > 0 and a deeper
    source, only the last w of them."""
    return slice(max(0, start - window) if window > 0 and source > layer else 0, start)


def group_runs(sources: list[int], layer: int, window: int,
               start: int) -> list[tuple[slice, slice, list[int]]]:
    """The finished groups of `layer`'s queries in the block at `start`, as runs of adjacent
    source layers that read the same history rows: (source layers, rows, depth offsets m - l)
    per run, each run one stacked view of the history buffers `[L, B, H_kv, T, d_h]`."""
    runs: list[list[tuple[int, slice]]] = []
    for m in sources:
        rows = group_rows(window, layer, m, start)
        if runs and runs[-1][-1] == (m - 1, rows):
            runs[-1].append((m, rows))
        else:
            runs.append([(m, rows)])
    return [(slice(run[0][0], run[-1][0] + 1), run[0][1], [m - layer for m, _ in run])
            for run in runs]


@dataclass(eq=False)
class GroupBatch:
    """Finished groups (or a decoding prefix) that a block's queries read in one kernel call.

    `k/v [g, B, H_kv, rows, d_h]` stack g groups of the same rows; `offsets` are their depth
    offsets m - l (0 for a prefix); `grads()` gives the `[g, B, H_kv, rows, d_h]` buffers their
    gradients are added to (None: no gradient wanted, as in decoding).
    """

    k: Tensor
    v: Tensor
    offsets: list[int]
    grads: Callable[[], tuple[Tensor, Tensor]] | None = None
    first: int = 0
    """Position of the first row (what `DocumentBounds` compare rows with)."""


class StoredHistory(Protocol):
    """A block's view of the history buffers (history.HistoryView), as backends read it."""

    anchor: Tensor | None
    """An input every reader takes so that its backward runs before the history hands the
    finished-KV gradients of earlier blocks out (history.py)."""

    @property
    def dtype(self) -> torch.dtype:
        """The buffers' dtype, which readers compute in."""

    window: int
    """deep_token_window (0 = off): how many rows a deeper source's group keeps (spec §3)."""

    def batches(self, layer: int) -> list[GroupBatch]:
        """`layer`'s finished groups, stacked where adjacent source layers read the same rows."""

    def sources(self, layer: int) -> list[int]:
        """M(layer): the source layers of `layer`'s finished groups."""

    def buffers(self) -> tuple[Tensor, Tensor]:
        """The whole key and value buffers `[L, B, H_kv, T, d_h]` (rows from the block's start
        on are not written yet), for readers that take fixed shapes (the `triton` backend)."""

    def gradient_buffers(self) -> tuple[Tensor, Tensor]:
        """The float32 buffers, shaped like `buffers()`, that readers add the groups' key and
        value gradients to."""

    def start_index(self) -> Tensor:
        """The block's first position as a 0-d int64 tensor on the buffers' device: readers
        that take it from device memory launch the same shapes for every block."""

    block_start: int | None
    """The block's first position, or None inside a static block step, whose readers take it
    from `start_index()` (and `batches` is then not available)."""

    done_reading: Callable[[], None] | None
    """Called by each reader's backward once its gradients are in the buffers (None: nobody
    is told; a static block step cannot call back into Python)."""


@dataclass(eq=False)
class PassDocuments:
    """One pass's document starts (spec §7) and what backends derive from them once per pass
    rather than once per (block, layer) cell: each block's readers take views (`DocumentBounds`),
    so a mask adds no kernel launch per cell."""

    starts: Tensor
    """`[B, T]` int64: the first position of each token's document."""
    block: int
    """The block size c the pass's blocks start at multiples of (T for one block)."""
    derived: dict[Any, Tensor] = field(default_factory=dict)

    def own_masks(self, dtype: torch.dtype) -> Tensor:
        """`[B, T, c]` in `dtype`: for each query, its float mask over the keys of its own block
        (0 read, -inf not: above the diagonal, or before its document); made once per pass."""
        key = ("own_masks", dtype)
        if key not in self.derived:
            length = self.starts.shape[1]
            c = min(self.block, length)
            position = torch.arange(length, device=self.starts.device)
            self.derived[key] = own_keys_mask(self.starts - position // c * c, position % c, c,
                                              dtype)
        return self.derived[key]


def own_keys_mask(relative: Tensor, row: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """`[B, n, width]` float: 0 where query i reads its block's key j, -inf where not (j above
    its row in the block `row [n]`, or before its document, `relative [B, n]`: the document's
    start counted from the block's)."""
    column = torch.arange(width, device=relative.device)
    hidden = (column < relative[..., None]) | (column > row[:, None])
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
        hidden, float("-inf"))


@dataclass(frozen=True)
class DocumentBounds:
    """Spec §7 for one block of queries: each query reads only keys of its own document, and
    documents are contiguous, so that is one lower bound per query row. A key at position j
    (the sample's, absolute) is read by query row r iff `j >= lower[:, r]`; the self slot
    always is (j = i). Backends skip key tiles wholly below a tile's smallest bound."""

    lower: Tensor
    """`[B, n]` int64: the first position of each query's document."""
    start: int | None
    """Position of the block's first query (its own keys' first position); None inside a
    static block step, whose readers take it from `StoredHistory.start_index()`."""
    shared: PassDocuments | None = None
    """The pass's documents, where the bounds are a block of them (None: the bounds alone)."""

    def allowed(self, positions: Tensor) -> Tensor:
        """`[B, 1, n, len]` bool: which of the keys at `positions [len]` each query reads
        (broadcasts over heads)."""
        return (positions[None, None, None, :] >= self.lower[:, None, :, None])

    def own_mask(self, dtype: torch.dtype) -> Tensor:
        """`[B, n, n]` in `dtype`: the float mask over the queries' own keys (0 read, -inf not:
        above the diagonal or before the query's document), a view of the pass's
        (`PassDocuments.own_masks`) where there is one."""
        n = self.lower.shape[1]
        if self.shared is not None and self.start is not None:
            return self.shared.own_masks(dtype)[:, self.start:self.start + n, :n]
        row = self.own_positions(n) - self.start
        return own_keys_mask(self.lower - self.start, row, n, dtype)

    def own_positions(self, n: int) -> Tensor:
        """Positions of the queries' own keys (the block's tokens), on the bounds' device."""
        if self.start is None:
            raise RuntimeError("a static block step's bounds have no Python start")
        return torch.arange(self.start, self.start + n, device=self.lower.device)


def consecutive(views: list[Tensor]) -> Tensor:
    """`views` (each `[B, n, …]`), the bounds or masks of consecutive blocks of n tokens, as one
    `[len(views), B, n, …]`: a strided view where they are consecutive slices of one tensor
    along dim 1 (a wave's cells, no copy), stacked otherwise."""
    first = views[0]
    step = first.shape[1] * first.stride(1)
    # Views of one base tensor (no data pointers: the compile step traces fake tensors).
    consecutive_views = first._base is not None and all(
        v._base is first._base and v.shape == first.shape and v.stride() == first.stride()
        and v.storage_offset() == first.storage_offset() + i * step
        for i, v in enumerate(views))
    if not consecutive_views:
        return torch.stack(views)
    return first.as_strided((len(views), *first.shape), (step, *first.stride()),
                            first.storage_offset())


@dataclass
class KeySet:
    """The keys one block of queries reads, `[B, H_kv, len, …]`: the queries' own keys with
    `head_dim` features, the history pieces in the backend's `KeyLayout`."""

    k: Tensor
    """Construction keys of the queries themselves (in-block keys and self slots)."""
    v: Tensor
    finished: list[tuple[int, Tensor, Tensor]] = field(default_factory=list)
    """(depth offset m - l, keys, values) per piece of a finished group (a group may come in
    several pieces, e.g. one per earlier block)."""
    finished_first: list[int] = field(default_factory=list)
    """Position of each `finished` piece's first key (read with `documents` only)."""
    prefix_k: Tensor | None = None
    """Construction keys of this block's earlier tokens that are not queries now (decoding)."""
    prefix_v: Tensor | None = None
    stored: StoredHistory | None = None
    """The history as buffers instead of `finished`/`prefix` pieces (training forward)."""
    documents: DocumentBounds | None = None
    """The queries' document bounds (spec §7); None: no document mask. Never with a decoding
    `prefix` (a cache holds one document)."""

    def history_pieces(self) -> tuple[list[Tensor], list[Tensor], list[int]]:
        """History pieces (finished groups, then prefix) with each piece's depth offset (their
        positions: `finished_first`)."""
        ks = [k for _, k, _ in self.finished]
        vs = [v for _, _, v in self.finished]
        offsets = [d for d, _, _ in self.finished]
        if self.prefix_k is not None and self.prefix_k.shape[2] > 0:
            ks.append(self.prefix_k)
            vs.append(self.prefix_v)
            offsets.append(0)
        return ks, vs, offsets


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared by it and read where a setting needs it: by the one
    chooser (`select.select_attention`) and by the model's static-step check."""

    devices: frozenset[str] | None
    """Device types its kernels run on (None: any)."""
    dropout: bool
    """Attention dropout."""
    static_step: bool
    """Reads the history at a start held in a tensor, so that one compiled or CUDA-graphed
    block step serves every block (`execution.compile`, `execution.cuda_graphs`)."""
    batched_waves: bool
    """A wave's cells in one call (`attend_wave`), rather than cell by cell."""
    documents: bool = False
    """Document masks (spec §7, `KeySet.documents`) in every path it serves."""
    static_waves: bool = False
    """A wave's cells in one call of `megabeta::history_attention`, their starts read from a
    tensor, so that one compiled wave step serves every wave of a kind (`execution.compile`
    on the wavefront schedule)."""


class AttentionBackend(Protocol):
    """One implementation of the block's softmax over its `KeySet`."""

    name: str
    """Its `execution.attention` name."""
    capabilities: Capabilities
    layout: KeyLayout
    """How keys and values are stored for it (history buffers, decode caches)."""
    reads_buffers: bool
    """Whether the training forward hands it the history as buffers (`KeySet.stored`) rather
    than as pieces."""

    def attend(self, q: Tensor, keys: KeySet, bias: AttentionBias, *, layer: int,
               dropout_p: float) -> Tensor:
        """Output `[B, H, n, d_h]` of queries `q [B, H, n, d_h]` of `layer` over `keys`."""

    def attend_wave(self, q: Tensor, k: Tensor, v: Tensor, keys: list[KeySet], bias: WaveBias,
                    *, layers: list[int], dropout_p: float) -> Tensor:
        """A wave's n cells (spec §5, model/wavefront.py) on consecutive blocks, oldest first,
        stacked: queries `q [n, B, H, c, d_h]`, construction keys and values
        `k, v [n, B, H_kv, c, d_h]`; cell i of `layers[i]` reads `keys[i]` (whose own keys are
        k[i], v[i]), with the cells' biases `bias`. Outputs `[n, B, c, H, d_h]` (heads last,
        as the output projection reads them)."""


class CellByCell:
    """`attend_wave` as one `attend` per cell, for backends without a batched wave."""

    def attend_wave(self: AttentionBackend, q: Tensor, k: Tensor, v: Tensor,
                    keys: list[KeySet], bias: WaveBias, *, layers: list[int],
                    dropout_p: float) -> Tensor:
        return stack_cells([self.attend(q_i, key_set, bias_i, layer=l,
                                        dropout_p=dropout_p).transpose(1, 2)
                            for q_i, key_set, bias_i, l in zip(split_cells(q), keys,
                                                               bias.per_cell(), layers)])


def causal_sdpa(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale: float, *,
                allowed: Tensor | None = None) -> Tensor:
    """SDPA with query r seeing keys `j <= (S - n) + r` (bottom-right causal), and of those only
    the ones `allowed [B, 1, n, S]` (bool; a document mask, spec §7) lets it, when given."""
    n, total = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if total == n and allowed is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                              scale=scale, enable_gqa=gqa)
    mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    if allowed is not None:
        mask = mask & allowed
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          scale=scale, enable_gqa=gqa)


def per_query_head(x: Tensor, heads: int) -> Tensor:
    """KV heads `[B, H_kv, …]` repeated for the query heads they serve (GQA); as is without GQA."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def after_backward(x: Tensor, callback: Callable[[], None] | None) -> Tensor:
    """`x`, with `callback` called once its gradient is formed: for the queries of an attention
    call, once that call's backward (which adds into the history's gradient buffers) is done."""
    if callback is None or not torch.is_grad_enabled():
        return x
    return HandOut.apply(x, _Notify(callback))


@dataclass(eq=False)
class _Notify:
    """A `layers.HandOut` collector that gathers nothing: it tells `callback` that the readers'
    backward has run."""

    callback: Callable[[], None]

    def collected(self) -> None:
        self.callback()
        return None
