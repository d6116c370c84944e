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

- Storage. One key and one value buffer per SOURCE layer m, `[B, H_kv, T, width]`, written once
  per block (`_Publish`). The group of source m that a block reads is rows [0, start) (or the
  deep-token window's rows): a view, no copy, and never rewritten afterwards.
- Attention. Per (block, layer), one flash-attention call per group and one for the block's own
  keys (the "tail": sink and in-block keys, causal), merged exactly by their log-sum-exps (the
  flash-decoding merge): `lse = logsumexp_g lse_g`, `o = Σ_g exp(lse_g - lse)·o_g`. The depth bias
  rides in each key's depth column (attention.py), so it is inside every lse_g. In backward the
  flash backward kernel of each group gets the MERGED output and lse, which makes it produce that
  group's exact share of the gradient (it forms P = exp(S - lse) and D = rowsum(dO∘O)).
- Gradients. The history is read from detached views, so autograd has no edge from readers to
  the finished-KV producers. `_ReadHistory` adds each group's key/value gradient into one
  gradient buffer per source layer; `_Publish` of block b hands block b's rows to the producers in
  its backward.
- Ordering comes from autograd itself. `_Publish` of block b returns an anchor tensor that every
  reader of block b+1 takes as input, so its backward runs after theirs; theirs run after
  `_Publish` of block b+1 (their outputs flow into block b+1's finished KVs), and so on: when
  block b's gradient is handed out, every later reader has added to it. `release` checks it.

The merge needs the kernels' log-sum-exp, which only the CPU flash kernels expose to us here
(`torch.ops.aten._scaled_dot_product_flash_attention_for_cpu[_backward]`). Elsewhere, and with
attention dropout, the groups are concatenated for one SDPA call and backward recomputes it with
autograd: exact, but with the copies.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

from megabeta.model.attention import KeySet, cpu_flash, flash_cpu, flash_cpu_backward, sdpa

History = list[tuple[Tensor, ...]]
"""Per source layer m, the finished K (or V) pieces covering tokens 0 … start(block)-1, in order."""


def group_rows(window: int, layer: int, source: int, start: int) -> slice:
    """Tokens of source layer `source`'s finished group that queries of `layer` in the block at
    `start` read (spec §3): all before the block, or with deep_token_window w > 0 and a deeper
    source, only the last w of them."""
    return slice(max(0, start - window) if window > 0 and source > layer else 0, start)


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

    def key_set(self, layer: int, k: Tensor, v: Tensor) -> KeySet:
        """Keys for the queries of `layer` whose own construction KVs are `k, v`."""
        finished = []
        for m in self.sources[layer] if self.block_start > 0 else ():
            rows = group_rows(self.window, layer, m, self.block_start)
            keep = rows.stop - rows.start
            finished += [(m - layer, pk, pv) for pk, pv in
                         zip(_tail(self.keys[m], keep), _tail(self.values[m], keep))]
        keys = KeySet(k=k, v=v, finished=finished)
        if self.prefix is not None:
            keys.prefix_k, keys.prefix_v = self.prefix[layer]
        return keys


class PieceHistory:
    """The growing history of one forward as per-block pieces per source layer."""

    def __init__(self, sources: list[list[int]], window: int) -> None:
        self.sources, self.window = sources, window
        self.keys: list[list[Tensor]] = [[] for _ in sources]
        self.values: list[list[Tensor]] = [[] for _ in sources]

    def view(self, block_start: int) -> PieceView:
        # Snapshots (tuples): a recomputed block must see exactly the pieces its forward saw.
        return PieceView(self.sources, self.window, block_start,
                         [tuple(p) for p in self.keys], [tuple(p) for p in self.values])

    def publish(self, block_start: int, fin_k: list[Tensor], fin_v: list[Tensor]) -> None:
        """Add a finished block's KVs (one per layer) to the history."""
        for pieces_k, pieces_v, k, v in zip(self.keys, self.values, fin_k, fin_v):
            pieces_k.append(k)
            pieces_v.append(v)

    def close(self) -> None:
        """End of the forward pass (nothing to release: the pieces are ordinary graph tensors)."""


class BufferedHistory:
    """The history of one forward pass in per-source buffers (module doc); one per forward call."""

    def __init__(self, sources: list[list[int]], window: int, length: int) -> None:
        self.sources, self.window, self.length = sources, window, length
        self.layers = len(sources)
        # Allocated at the first publish in the finished keys' shape and dtype (under autocast
        # whatever the projections and RoPE made of them, not necessarily the embedding's),
        # which readers then compute in.
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.grad_keys: list[Tensor] | None = None
        self.grad_values: list[Tensor] | None = None
        self.published = 0
        """Tokens whose finished KVs have been written."""
        self.starts: list[int] = []
        """Start of every published block."""
        self.read_back: dict[int, int] = {}
        """Per block start, how many layers' readers have run backward."""
        self._anchor: Tensor | None = None

    def view(self, block_start: int) -> "BufferedView":
        return BufferedView(self, block_start, self._anchor)

    def publish(self, block_start: int, fin_k: list[Tensor], fin_v: list[Tensor]) -> None:
        """Make a finished block's KVs (one per layer) visible to every later block."""
        self._anchor = _Publish.apply(self, block_start, *fin_k, *fin_v)

    def close(self) -> None:
        """End of the forward pass: drop the last anchor. The autograd nodes hold this history
        (their ctx) and the anchor holds its node: kept, that cycle would keep every step's
        buffers and graph alive until a full garbage collection."""
        self._anchor = None

    def groups(self, layer: int, start: int) -> list[tuple[int, slice]]:
        """(source layer, history rows) of each finished group the block at `start` reads."""
        return [(m, group_rows(self.window, layer, m, start)) for m in self.sources[layer]]

    # ---- used by the autograd functions ---------------------------------------------------------
    def write_finished(self, start: int, fin_k: tuple[Tensor, ...],
                       fin_v: tuple[Tensor, ...]) -> None:
        if start != self.published:
            raise RuntimeError(f"finished KVs published out of order (block at {start}, "
                               f"expected {self.published})")
        if not self.keys:
            batch, heads, _, width = fin_k[0].shape
            shape = (batch, heads, self.length, width)
            # One dtype for both (the kernels take one): under autocast, RoPE's float32 tables
            # promote keys to float32 while values stay bf16.
            self.keys = [fin_k[0].new_empty(shape) for _ in range(self.layers)]
            self.values = [fin_k[0].new_empty(shape) for _ in range(self.layers)]
        n = fin_k[0].shape[2]
        self.starts.append(start)
        for m in range(self.layers):
            self.keys[m][:, :, start:start + n] = fin_k[m]
            self.values[m][:, :, start:start + n] = fin_v[m]
        self.published = start + n

    def grads(self, m: int, rows: slice) -> tuple[Tensor, Tensor]:
        """The gradient buffers (K, V) of source `m`'s history `rows`, for readers to add to."""
        if self.grad_keys is None:
            # Summed over every later block: in float32 even when the history is bf16.
            dtype = torch.promote_types(self.keys[0].dtype, torch.float32)
            self.grad_keys = [torch.zeros_like(k, dtype=dtype) for k in self.keys]
            self.grad_values = [torch.zeros_like(v, dtype=dtype) for v in self.values]
        return self.grad_keys[m][:, :, rows], self.grad_values[m][:, :, rows]

    def add_grad(self, m: int, rows: slice, dk: Tensor, dv: Tensor) -> None:
        """Add a reader's gradient of source `m`'s history `rows`."""
        grad_k, grad_v = self.grads(m, rows)
        grad_k.add_(dk)
        grad_v.add_(dv)

    def release(self, start: int, n: int) -> list[Tensor | None]:
        """Gradients of the finished KVs of the block at `start` (all later readers are done)."""
        later = [s for s in self.starts if s > start] + [self.published]
        if any(self.read_back.get(s, 0) != self.layers for s in later):
            raise RuntimeError("finished-KV gradients handed out before every later block's "
                               "attention ran backward (autograd ordering broken)")
        if self.grad_keys is None:
            grads = [None] * (2 * self.layers)
        else:
            rows, dtype = slice(start, start + n), self.keys[0].dtype
            grads = ([g[:, :, rows].to(dtype, copy=True) for g in self.grad_keys]
                     + [g[:, :, rows].to(dtype, copy=True) for g in self.grad_values])
        if start == 0:
            # The first block's gradients are the last to go: nobody reads the buffers again.
            # Dropped here because torch's non-reentrant checkpoint keeps its inputs (our views)
            # in a reference cycle until the garbage collector runs: with block checkpointing,
            # this history would otherwise outlive the step.
            self.keys, self.values, self.grad_keys, self.grad_values = [], [], None, None
        return grads


@dataclass
class BufferedView:
    """What one block reads of a `BufferedHistory`."""

    history: BufferedHistory
    block_start: int
    anchor: Tensor | None

    def key_set(self, layer: int, k: Tensor, v: Tensor) -> KeySet:
        if self.block_start == 0:
            return KeySet(k=k, v=v)
        return KeySet(k=k, v=v, stored=self)

    def attend(self, layer: int, q: Tensor, k_tail: Tensor, v_tail: Tensor, dropout_p: float,
               scale: float) -> Tensor:
        """Attention of `q` over the finished groups of `layer` and the tail `k_tail/v_tail`,
        in the history's dtype (the kernels take one dtype; autocast does not reach them)."""
        dtype = self.history.keys[0].dtype
        return _ReadHistory.apply(q.to(dtype), k_tail.to(dtype), v_tail.to(dtype), self.anchor,
                                  self.history, layer, self.block_start, dropout_p, scale)


class _Publish(torch.autograd.Function):
    """Forward: write a block's finished KVs into the buffers; return the anchor.
    Backward: return those KVs' gradients, accumulated by every later reader."""

    @staticmethod
    def forward(ctx: Any, history: BufferedHistory, start: int, *kv: Tensor) -> Tensor:
        layers = len(kv) // 2
        history.write_finished(start, kv[:layers], kv[layers:])
        ctx.history, ctx.start, ctx.n = history, start, kv[0].shape[2]
        return kv[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:
        return (None, None, *ctx.history.release(ctx.start, ctx.n))




class _ReadHistory(torch.autograd.Function):
    """Attention over a block's finished groups (buffer views) and its tail; see the module doc."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k_tail: Tensor, v_tail: Tensor, anchor: Tensor,
                history: BufferedHistory, layer: int, start: int, dropout_p: float,
                scale: float) -> Tensor:
        ctx.args = history, layer, start, dropout_p, scale
        groups = history.groups(layer, start)
        ctx.merged = cpu_flash(q, dropout_p)
        if not ctx.merged:
            ctx.rng = _rng_state(q.device) if dropout_p else None
            ctx.save_for_backward(q, k_tail, v_tail)
            keys = [history.keys[m][:, :, rows] for m, rows in groups]
            values = [history.values[m][:, :, rows] for m, rows in groups]
            return sdpa(q, torch.cat([*keys, k_tail], 2), torch.cat([*values, v_tail], 2),
                        dropout_p, scale)
        parts = [flash_cpu(q, history.keys[m][:, :, rows], history.values[m][:, :, rows], 0.0,
                        False, scale=scale) for m, rows in groups]
        parts.append(flash_cpu(q, k_tail, v_tail, 0.0, True, scale=scale))
        lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)
        # The kernels' lse is float32 even for bf16 inputs: merge in it, return the input dtype.
        out = sum(torch.exp(part_lse - lse).unsqueeze(-1) * part_out
                  for part_out, part_lse in parts).to(q.dtype)
        ctx.save_for_backward(q, k_tail, v_tail, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        history, layer, start, dropout_p, scale = ctx.args
        groups = history.groups(layer, start)
        if ctx.merged:
            q, k_tail, v_tail, out, lse = ctx.saved_tensors
            grad = grad.contiguous()
            dq, dk_tail, dv_tail = flash_cpu_backward(grad, q, k_tail, v_tail, out, lse, 0.0, True,
                                                   scale=scale)
            by_matmul = q.dtype in (torch.float32, torch.float64)
            delta = (grad * out).sum(-1) if by_matmul else None
            for m, rows in groups:
                k, v = history.keys[m][:, :, rows], history.values[m][:, :, rows]
                if by_matmul:
                    dq = dq + _group_backward(grad, q, k, v, lse, delta, scale,
                                              *history.grads(m, rows))
                    continue
                dq_g, dk, dv = flash_cpu_backward(grad, q, k, v, out, lse, 0.0, False,
                                               scale=scale)
                dq = dq + dq_g
                history.add_grad(m, rows, dk, dv)
        else:
            q, k_tail, v_tail = ctx.saved_tensors
            # No kernel to call directly: recompute with autograd over leaves that alias the
            # buffers, replaying the forward's dropout.
            with torch.enable_grad(), _restored_rng(ctx.rng, q.device):
                keys = [history.keys[m][:, :, rows].detach().requires_grad_()
                        for m, rows in groups]
                values = [history.values[m][:, :, rows].detach().requires_grad_()
                          for m, rows in groups]
                leaves = [t.detach().requires_grad_() for t in (q, k_tail, v_tail)]
                out = sdpa(leaves[0], torch.cat([*keys, leaves[1]], 2),
                           torch.cat([*values, leaves[2]], 2), dropout_p, scale)
                dq, dk_tail, dv_tail, *dkv = torch.autograd.grad(out, leaves + keys + values,
                                                                 grad)
            for (m, rows), dk, dv in zip(groups, dkv[:len(groups)], dkv[len(groups):]):
                history.add_grad(m, rows, dk, dv)
        history.read_back[start] = history.read_back.get(start, 0) + 1
        return (dq, dk_tail, dv_tail, grad.new_zeros(()), None, None, None, None, None)


def _group_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                    scale: float, grad_k: Tensor, grad_v: Tensor) -> Tensor:
    """Backward of one finished group by matmuls, given the MERGED lse and `delta` =
    rowsum(grad ∘ merged out) (module doc); adds dK/dV into `grad_k/grad_v` (the buffers'
    rows) and returns dQ. (Not `baddbmm_` into the rows: on a strided output it falls back to one
    matmul per head.)

    A block's few queries over a long history are a poor fit for the flash backward kernel: these
    matmuls measured 1.5-1.8x faster for 768-2048 keys (float32, 2 threads) and equal at 256.
    Query heads that share a KV head (GQA) are stacked as rows of one matrix.
    """
    batch, heads, n, width = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    rows = heads // kv_heads * n
    qg = q.reshape(batch * kv_heads, rows, width)
    gg = grad.reshape(batch * kv_heads, rows, grad.shape[-1])
    kg = k.reshape(batch * kv_heads, length, width)
    vg = v.reshape(batch * kv_heads, length, v.shape[-1])
    p = torch.bmm(qg, kg.transpose(1, 2)).mul_(scale)
    p = p.sub_(lse.reshape(batch * kv_heads, rows, 1)).exp_()
    grad_v.add_(torch.bmm(p.transpose(1, 2), gg).view(grad_v.shape))
    ds = torch.bmm(gg, vg.transpose(1, 2)).sub_(delta.reshape(batch * kv_heads, rows, 1))
    ds = ds.mul_(p).mul_(scale)
    grad_k.add_(torch.bmm(ds.transpose(1, 2), qg).view(grad_k.shape))
    return torch.bmm(ds, kg).view(batch, heads, n, width)


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
