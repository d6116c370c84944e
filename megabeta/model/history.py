"""The finished-KV history of one forward pass: what each block reads of the blocks before it.

Spec §3: queries of block b at layer l read the finished KVs of the source layers m ∈ M(l) of all
tokens before start(b). Two ways to hand them to attention live here:

`PieceHistory` keeps, per source layer, a list of per-block tensors and gives attention the pieces
(`PieceView`); the key set is concatenated per (block, layer). It serves the explicit attention
path and, built over the decode cache, decoding.

`BufferedHistory` is the training path of fused attention. Concatenating a growing history for
every (block, layer) copies O(T²/c) numbers per forward, and under autograd each copy is kept for
backward (design notes, "The block loop"); at c = 32 those copies cost more than the attention.
Instead:

- Storage. One key and one value buffer for all source layers, `[L, B, H_kv, T, d_h]`, written
  once per block (`_Publish`). The group of source m that a block reads is rows [0, start) of
  layer m (or the deep-token window's rows): a view, no copy, and never rewritten afterwards.
  Adjacent source layers that read the same rows are one view `[g, B, H_kv, rows, d_h]`, which
  the backends attend to in one kernel call (`HistoryView.batches`).
- Attention. A `HistoryView` is what the backends read (`attention.backend.StoredHistory`):
  the cpu backends attend to the groups and the block's own keys as parts merged by log-sum-exp;
  the triton backend reads the groups' rows straight from the buffers in one kernel.
- Gradients. The history is read from detached views, so autograd has no edge from readers to
  the finished-KV producers. Readers add each group's key/value gradient into one gradient
  buffer shaped like the storage; `_Publish` of block b hands block b's rows to the producers in
  its backward.
- Ordering comes from autograd itself. Each publish returns an anchor tensor; every reader
  created after it takes the anchor as input, and the next publish takes it too. So a publish's
  backward runs after every later reader's (directly, or through the chain of later publishes):
  when a finished KV's gradient is handed out, every reader of it has added to it. `release`
  checks it. A publish is a set of cells (block start, layer): all layers of one block in the
  block schedule, one cell per layer of a wave in the wavefront (model/wavefront.py).
- Reuse. On CPU a fresh tensor this large is mapped anew and page-faulted on first touch in
  every pass (about a tenth of a beta_1.2_test step went to the buffers' allocation and first
  writes); a `BufferPool` the model holds lends the same buffers to one pass after another
  (CUDA's caching allocator reuses its blocks already: no pool there). A pass gives them back
  when its first publish's gradients are handed out (nothing reads them after that) or, when
  no backward comes, once the history is gone.
- The static steps (beta12 `compile_steps`: the compiled block or wave step; CUDA graphs) read
  the same type of view (`step_view`): the buffers, allocated before block 0 (`allocate`), and
  the block's start as a 0-d tensor only, so that nothing a traced graph sees differs between
  blocks. Their readers cannot call back into Python, so `release` does not check the order
  there (`check_order`), and what they save for backward is saved unchecked (`saved_unchecked`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from megabeta.model.attention.backend import (
    DocumentBounds,
    GroupBatch,
    PassDocuments,
    KeySet,
    group_rows,
    group_runs,
)

History = list[tuple[Tensor, ...]]
"""Per source layer m, the finished K (or V) pieces covering tokens 0 … start(block)-1, in order."""

Cell = tuple[int, int]
"""(block start, layer): whose finished KVs one publish carries."""


def block_cells(block_start: int, layers: int) -> list[Cell]:
    """Every layer of the block at `block_start` (the block schedule's publish)."""
    return [(block_start, m) for m in range(layers)]


def _tail(pieces: tuple[Tensor, ...], keep: int) -> list[Tensor]:
    """The last `keep` tokens of a history given as pieces `[B, H, len, d_h]`."""
    out: list[Tensor] = []
    for piece in reversed(pieces):
        if keep <= 0:
            break
        length = piece.shape[2]
        out.append(piece if length <= keep else piece[:, :, length - keep:])
        keep -= length
    return out[::-1]


@dataclass
class PieceView:
    """What one block reads, as per-block pieces per source layer (plus, when decoding, the
    construction KVs of the block's tokens before the current ones)."""

    sources: list[list[int]]
    """M(l) per layer l."""
    window: int
    """deep_token_window (0 = off)."""
    block_start: int
    keys: History
    values: History
    prefix: list[tuple[Tensor, Tensor]] | None = None
    documents: PassDocuments | None = None
    """The pass's documents (spec §7); None: no mask."""

    def key_set(self, layer: int, k: Tensor, v: Tensor) -> KeySet:
        """Keys for the queries of `layer` whose own construction KVs are `k, v`."""
        finished, first = [], []
        for m in self.sources[layer] if self.block_start > 0 else ():
            rows = group_rows(self.window, layer, m, self.block_start)
            keep = rows.stop - rows.start
            for pk, pv in zip(_tail(self.keys[m], keep), _tail(self.values[m], keep)):
                finished.append((m - layer, pk, pv))
                first.append(rows.start)
                rows = slice(rows.start + pk.shape[2], rows.stop)
        keys = KeySet(k=k, v=v, finished=finished, finished_first=first,
                      documents=block_bounds(self.documents, self.block_start, k.shape[2]))
        if self.prefix is not None:
            keys.prefix_k, keys.prefix_v = self.prefix[layer]
        return keys


def block_bounds(documents: PassDocuments | None, start: int,
                 n: int) -> DocumentBounds | None:
    """The document bounds of the `n` queries from `start` on, from the pass's documents (a
    view: no kernel per block)."""
    if documents is None:
        return None
    return DocumentBounds(documents.starts[:, start:start + n], start, documents)


class PieceHistory:
    """The growing history of one forward as per-block pieces per source layer; `documents`:
    the pass's documents (None: no document mask)."""

    def __init__(self, sources: list[list[int]], window: int,
                 documents: PassDocuments | None = None) -> None:
        self.sources, self.window, self.documents = sources, window, documents
        self.keys: list[list[Tensor]] = [[] for _ in sources]
        self.values: list[list[Tensor]] = [[] for _ in sources]

    def view(self, block_start: int) -> PieceView:
        # Snapshots (tuples): a recomputed block must see exactly the pieces its forward saw.
        return PieceView(self.sources, self.window, block_start,
                         [tuple(p) for p in self.keys], [tuple(p) for p in self.values],
                         documents=self.documents)

    def publish(self, cells: list[Cell], fin_k: list[Tensor], fin_v: list[Tensor]) -> None:
        """Add the finished KVs of `cells` (each layer's blocks in order) to the history."""
        for (_, m), k, v in zip(cells, fin_k, fin_v):
            self.keys[m].append(k)
            self.values[m].append(v)

    def close(self) -> None:
        """End of the forward pass (nothing to release: the pieces are ordinary graph tensors)."""


class BufferPool:
    """History buffers kept from one pass for the next (module doc, "Reuse"): one tensor per
    (kind, shape, dtype, device), lent to one pass at a time. A pass that starts while another
    still holds them (an evaluation forward between a forward and its backward) gets fresh
    ones."""

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], Tensor] = {}

    def lend(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> Tensor:
        """A tensor of `shape` (contents undefined), the kept one when it is free."""
        kept = self._free.pop((kind, tuple(shape), dtype, torch.device(device)), None)
        return torch.empty(shape, dtype=dtype, device=device) if kept is None else kept

    def give_back(self, kind: str, t: Tensor) -> None:
        self._free[(kind, tuple(t.shape), t.dtype, t.device)] = t


class _Loan:
    """What one history borrowed from a pool, given back once (`settle`)."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self.items: list[tuple[str, Tensor]] = []

    def take(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> Tensor:
        t = self.pool.lend(kind, shape, dtype, device)
        self.items.append((kind, t))
        return t

    def settle(self) -> None:
        for kind, t in self.items:
            self.pool.give_back(kind, t)
        self.items.clear()


class BufferedHistory:
    """The history of one forward pass in stacked buffers (module doc); one per forward call.
    `dtype`: the buffers' (the attention backend's choice, `KeyLayout.stored_dtype`); `pool`:
    where its buffers come from and go back to (None: fresh ones each pass)."""

    def __init__(self, sources: list[list[int]], window: int, length: int, *,
                 dtype: torch.dtype, check_order: bool = True,
                 pool: BufferPool | None = None,
                 documents: PassDocuments | None = None) -> None:
        self.sources, self.window, self.length = sources, window, length
        self.documents = documents
        """The pass's documents (spec §7); None: no document mask."""
        self.dtype = dtype
        self._loan = None if pool is None else _Loan(pool)
        if self._loan is not None:
            # No backward (a forward without autograd, or a graph dropped unused): given back
            # when this history goes. Every reader's graph holds it through the publishes.
            weakref.finalize(self, self._loan.settle)
        self.check_order = check_order
        """Whether `release` checks that every later reader ran backward (readers report it
        through `done_reading`; a compiled block step cannot call back into Python)."""
        self.layers = len(sources)
        # Allocated at the first publish (or by `allocate`) in the finished keys' shape, in
        # `dtype`, which readers then compute in.
        self.keys: Tensor | None = None
        """`[L, B, H_kv, T, d]`: finished keys of every layer (source)."""
        self.values: Tensor | None = None
        self.grad_keys: Tensor | None = None
        self.grad_values: Tensor | None = None
        self.published = [0] * self.layers
        """Per layer, the tokens whose finished KVs have been written."""
        self.publishes: list[list[Cell]] = []
        """The cells of every publish, in order (a publish's index is its epoch)."""
        self.reads: list[Reads] = []
        """The readers of every view handed out, in order (not the views: they hold this
        history, and a cycle would keep it alive until a garbage collection)."""
        self._checked = 0
        """`reads[_checked:]` are known to have run backward (`release`)."""
        self.positions: Tensor | None = None
        """`arange(T)` on the buffers' device: a block's start as a 0-d tensor is a view of it."""
        self._anchor: Tensor | None = None
        self.zero: Tensor | None = None
        """The 0-d zero every publish's anchor is a view of."""

    def view(self, block_start: int) -> "HistoryView":
        """What the block at `block_start` reads, eagerly (its start known to Python)."""
        reads = Reads(len(self.publishes))
        if self.check_order:
            self.reads.append(reads)
            self._checked = len(self.reads)
        start = None if self.positions is None else self.positions[block_start]
        return HistoryView(self, self.keys, self.values, start, block_start, self._anchor,
                           reads if self.check_order else None)

    def shape(self, batch: int, heads: int, width: int) -> tuple[int, ...]:
        """The buffers' shape for `batch` sequences of `heads` KV heads of `width`."""
        return (self.layers, batch, heads, self.length, width)

    def allocate(self, batch: int, heads: int, width: int, *, device: torch.device,
                 buffers: tuple[Tensor, Tensor, Tensor, Tensor] | None = None) -> None:
        """Allocate the buffers (and, under autograd, the gradient buffers) before the first
        block, for `step_view`: a static block step reads the same tensors from block 0 on.
        `buffers`: keys, values and zeroed gradient buffers to use instead (a captured step's,
        at fixed addresses). The first block's anchor is a leaf that asks for a gradient, like
        every later one."""
        shape, dtype = self.shape(batch, heads, width), self.dtype
        if buffers is not None:
            self.keys, self.values, grad_keys, grad_values = buffers
            if torch.is_grad_enabled():
                self.grad_keys, self.grad_values = grad_keys, grad_values
        else:
            self.keys, self.values = (self._new(kind, shape, dtype, device)
                                      for kind in ("keys", "values"))
            if torch.is_grad_enabled():
                self.gradient_buffers()
        self.positions = torch.arange(self.length, device=device)
        self._anchor = torch.zeros((), dtype=dtype, device=device,
                                   requires_grad=torch.is_grad_enabled())

    def step_view(self, block_start: int, n: int) -> "HistoryView":
        """What the block of `n` tokens at `block_start` reads in a static step, with its start
        as a tensor only (`allocate` first)."""
        lower = (None if self.documents is None
                 else self.documents.starts[:, block_start:block_start + n])
        # Without autograd `allocate` made no gradient buffers: empty stand-ins.
        grads = (self.gradient_buffers() if self.grad_keys is not None
                 else (self.keys.new_empty(0), self.keys.new_empty(0)))
        return HistoryView(self, self.keys, self.values, self.positions[block_start], None,
                           self._anchor, grads=grads, lower=lower)

    def publish(self, cells: list[Cell], fin_k: list[Tensor], fin_v: list[Tensor]) -> None:
        """Make the finished KVs of `cells` visible to every later reader (each layer's blocks
        in order)."""
        self._anchor = _Publish.apply(self, list(cells), self._anchor, *fin_k, *fin_v)

    def close(self) -> None:
        """End of the forward pass: drop the last anchor. The autograd nodes hold this history
        (their ctx) and the anchor holds its node: kept, that cycle would keep every step's
        buffers and graph alive until a full garbage collection."""
        self._anchor = None

    # ---- used by the readers and the autograd functions -----------------------------------------
    def write_finished(self, cells: list[Cell], fin_k: tuple[Tensor, ...],
                       fin_v: tuple[Tensor, ...]) -> None:
        for start, m in cells:
            if start != self.published[m]:
                raise RuntimeError(f"finished KVs published out of order (layer {m}, block at "
                                   f"{start}, expected {self.published[m]})")
        if self.keys is None:
            batch, heads, _, width = fin_k[0].shape
            shape = (self.layers, batch, heads, self.length, width)
            # One dtype for both (the kernels take one); the copies below cast to it.
            self.keys, self.values = (self._new(kind, shape, self.dtype, fin_k[0].device)
                                      for kind in ("keys", "values"))
            self.positions = torch.arange(self.length, device=self.keys.device)
        n = fin_k[0].shape[2]
        for (start, m), k, v in zip(cells, fin_k, fin_v):
            self.keys[m, :, :, start:start + n] = k
            self.values[m, :, :, start:start + n] = v
            self.published[m] = start + n
        self.publishes.append(cells)

    def gradient_buffers(self) -> tuple[Tensor, Tensor]:
        """The gradient buffers (K, V), shaped like the storage, that readers add to."""
        if self.grad_keys is None:
            # Summed over every later block: in float32 even when the history is bf16.
            dtype = torch.promote_types(self.keys.dtype, torch.float32)
            self.grad_keys, self.grad_values = (
                self._new(kind, self.keys.shape, dtype, self.keys.device).zero_()
                for kind in ("grad_keys", "grad_values"))
        return self.grad_keys, self.grad_values

    def _new(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> Tensor:
        """A buffer (contents undefined): from the pool where there is one."""
        if self._loan is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return self._loan.take(kind, shape, dtype, device)

    def grads(self, sources: slice, rows: slice) -> tuple[Tensor, Tensor]:
        """The gradient buffers (K, V) of `sources`' history `rows` (`[g, B, H_kv, rows, d]`),
        for readers to add to."""
        grad_keys, grad_values = self.gradient_buffers()
        return grad_keys[sources, :, :, rows], grad_values[sources, :, :, rows]

    def release(self, epoch: int, n: int, dtypes: list[torch.dtype]) -> list[Tensor | None]:
        """Gradients (keys, then values) of the finished KVs of publish `epoch`'s cells, of `n`
        tokens each, in `dtypes` (the KVs'): every reader created after that publish must have
        run backward."""
        # Publishes are released in reverse order: only the views since the previous release
        # are left to check.
        reads, first = self.reads, self._checked
        while first > 0 and reads[first - 1].epoch > epoch:
            first -= 1
        if any(not r.all_done() for r in reads[first:self._checked]):
            raise RuntimeError("finished-KV gradients handed out before every later reader's "
                               "attention ran backward (autograd ordering broken)")
        self._checked = first
        cells = self.publishes[epoch]
        if self.grad_keys is None:
            grads = [None] * (2 * len(cells))
        else:
            # Views where no cast is needed: every reader of these rows is done, nothing
            # writes them again.
            rows = [g[m, :, :, start:start + n]
                    for g in (self.grad_keys, self.grad_values) for start, m in cells]
            grads = [g.to(dtype) for g, dtype in zip(rows, dtypes)]
        if epoch == 0:
            # The first publish's gradients are the last to go: nobody reads the buffers again.
            # Dropped here because torch's non-reentrant checkpoint keeps its inputs (our views)
            # in a reference cycle until the garbage collector runs: with block checkpointing,
            # this history would otherwise outlive the step.
            self.keys = self.values = self.grad_keys = self.grad_values = self.positions = None
            if self._loan is not None:
                # The gradients above are views of the gradient buffers: the rest of this
                # backward reads them before any later pass takes the buffers again.
                self._loan.settle()
        return grads


@dataclass(eq=False)
class Reads:
    """Who read one view, for `BufferedHistory.release`'s check."""

    epoch: int
    """The publishes before the view: its readers must run backward before theirs."""
    layers: set[int] = field(default_factory=set)
    """Layers whose queries read the view (a recompute reads again: a set)."""
    done: int = 0
    """Readers that ran backward."""

    def all_done(self) -> bool:
        return self.done == len(self.layers)

    def reader_done(self) -> None:
        self.done += 1


@dataclass
class HistoryView:
    """What one block (or one cell of a wave) reads of a `BufferedHistory`: the buffers, the
    block's start as a 0-d tensor, the anchor its readers take and, where Python knows it, the
    start as a number. The eager paths know it (`BufferedHistory.view`: groups are sliced at
    it, `batches`); the static block step does not (`BufferedHistory.step_view`, and the
    CUDA-graphed step's view of its fixed buffers): nothing a traced graph sees then differs
    between blocks, and its readers take the start from device memory (the operator
    `megabeta::history_attention`, kernels/history_attention.py: `triton`, and `cpu_fused`
    through `attention/merged_op.py`) and report nothing back (`reads` None)."""

    history: BufferedHistory
    keys: Tensor | None
    """The history's key buffer `[L, B, H_kv, T, d_h]`, held by the view: a recomputed block
    reads it after the history has let its buffers go (None: nothing published yet, a first
    block read eagerly, which reads no rows)."""
    values: Tensor | None
    start: Tensor | None
    """The block's first position, 0-d int64 on the buffers' device (None with `keys`)."""
    block_start: int | None
    """The same as a Python number; None inside a static block step."""
    anchor: Tensor | None
    reads: Reads | None = None
    """Who read this view, for the history's order check (None: not checked)."""
    grads: tuple[Tensor, Tensor] | None = None
    """A static step's gradient buffers (empty without autograd), held like `keys`; an eager
    view asks the history, which allocates them on first use."""
    lower: Tensor | None = None
    """A static step's document bounds `[B, n]` (`DocumentBounds.lower`; an eager view takes
    them from the history's documents at `block_start`); None: no mask."""

    def key_set(self, layer: int, k: Tensor, v: Tensor) -> KeySet:
        """Keys for the queries of `layer` whose own construction KVs are `k, v`."""
        if self.block_start is None:
            # The first block too: it reads no rows (start 0), through the same graph.
            documents = None if self.lower is None else DocumentBounds(self.lower, None)
            return KeySet(k=k, v=v, stored=self, documents=documents)
        documents = block_bounds(self.history.documents, self.block_start, k.shape[2])
        if self.block_start == 0:
            return KeySet(k=k, v=v, documents=documents)
        if self.reads is not None:
            self.reads.layers.add(layer)
        return KeySet(k=k, v=v, stored=self, documents=documents)

    def batches(self, layer: int) -> list[GroupBatch]:
        """The finished groups of `layer` as stacked batches: runs of adjacent source layers
        that read the same rows, each one view of the buffers."""
        if self.block_start is None:
            raise RuntimeError("a static block step has no Python start to slice groups at: its "
                               "readers take the buffers and start_index()")
        history = self.history
        return [GroupBatch(self.keys[sources, :, :, rows], self.values[sources, :, :, rows],
                           offsets, lambda sources=sources, rows=rows: history.grads(sources, rows),
                           first=rows.start)
                for sources, rows, offsets in group_runs(history.sources[layer], layer,
                                                         history.window, self.block_start)]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def done_reading(self) -> Callable[[], None] | None:
        return None if self.reads is None else self.reads.reader_done

    @property
    def window(self) -> int:
        return self.history.window

    def sources(self, layer: int) -> list[int]:
        return self.history.sources[layer]

    def buffers(self) -> tuple[Tensor, Tensor]:
        return self.keys, self.values

    def gradient_buffers(self) -> tuple[Tensor, Tensor]:
        return self.history.gradient_buffers() if self.grads is None else self.grads

    def start_index(self) -> Tensor:
        return self.start


class _Publish(torch.autograd.Function):
    """Forward: write a block's finished KVs into the buffers; return the anchor.
    Backward: return those KVs' gradients, accumulated by every later reader."""

    @staticmethod
    def forward(ctx: Any, history: BufferedHistory, cells: list[Cell], previous: Tensor | None,
                *kv: Tensor) -> Tensor:
        # `previous`, the anchor before this one, is taken only to chain the publishes: its
        # publish's backward then runs after this one's.
        history.write_finished(cells, kv[:len(cells)], kv[len(cells):])
        ctx.history, ctx.epoch, ctx.n = history, len(history.publishes) - 1, kv[0].shape[2]
        ctx.dtypes = [t.dtype for t in kv]
        # The anchor's gradient is never read: not zero-filled either (readers return none).
        # Its value is read by nobody but a compiled step's guards: dynamo takes a 0-d CPU
        # float input as a number and guards that it is not NaN, which uninitialized memory
        # sometimes is (a recompile). So zero, as `allocate`'s first anchor, in the buffers'
        # dtype (a compiled step sees one dtype): a view of one zero per history, which costs
        # no kernel per publish.
        ctx.set_materialize_grads(False)
        if history.zero is None:
            history.zero = history.keys.new_zeros(())
        return history.zero.view(())

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:
        return (None, None, None, *ctx.history.release(ctx.epoch, ctx.n, ctx.dtypes))


def saved_unchecked() -> contextlib.AbstractContextManager:
    """Save tensors for backward as they are, without autograd's version check. A static step
    saves its inputs, the history buffers among them, which later blocks then write (publish;
    their backward adds into the gradient buffers) at rows this step never reads: the check
    would refuse what is correct. (The eager readers hold the buffers unsaved.)"""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(t: Tensor) -> Tensor:
    return t
