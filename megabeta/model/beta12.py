"""Beta12Transformer: the model of spec §1-§4, its per-pass weights and its decoding.

Every layer reads the finished KVs of earlier blocks (the history) for its source layers M(l),
plus construction KVs inside the block. When a block has passed layer m, its finished KV of
layer m (layer m's own norm and K/V weights on its OUTPUT, plus e_K/e_V) is computed once and
added to the history; the last block's are skipped in training because nobody reads them.

A training pass builds its weights once (`PassWeights`, `PassBiases`) and its history
(`history.py`: buffers read without copies for the backends that take them, per-block pieces
for the explicit backend and decoding), then runs the schedule `execution.schedule` names
(schedule.py: the block schedule, block_schedule.py, or the wavefront, wavefront.py; both run
wave.py's cells). Its recompute unit (a block or a wave) is recomputed in backward from its
inputs and the same history (spec §4.6). The LM head and loss run after, in chunks
(`DecoderLM.head`).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from megabeta.model.attention import BiasRows, PassDocuments, WaveBias
from megabeta.model.step_graphs import CudaCapture, StepGraphs
from megabeta.model.cache import DecodeCache
from megabeta.model.config import ConfigError
from megabeta.model.documents import padded_starts
from megabeta.model.history import (
    BufferPool,
    BufferedHistory,
    HistoryView,
    PieceHistory,
    PieceView,
)
from megabeta.model.layers import (
    BranchWeights,
    Projection,
    StackedWeight,
    autocast_dtype,
    fused_input_rows,
)
from megabeta.model.transformer import DecoderLM, ParallelPlan
from megabeta.model.block_schedule import run_block
from megabeta.model.schedule import SCHEDULES, Schedule


class PassWeights:
    """The weights of one pass, built once from the parameters (layers.Projection,
    layers.StackedWeight), each kind stacked over the layers in REVERSE order: a wave's cells
    (layers stepping down by the period, wave.py) read one strided view of a stack, a wave of
    one cell (a layer of the block schedule) the view of one (`index(l)`).

    - `plain[l]`: layer l's input projection (queries, construction K/V; norm weight folded
      in), for layer 0 (a block entering) and, unless `batched` (the wavefront, which builds
      only layer 0's), for a block whose finished KVs nobody reads (the last in training);
    - `next`: layers L-1 … 1's input projections, each fused with the layer below's finished
      K/V (5 projections, 2 norm weights folded in: one matmul, `input(l, finished=True)`);
    - `last_finished`: the last layer's finished K/V from the block's final hidden states;
    - `out`, `gate_up`, `down`: W_O, SwiGLU's gate and up (ffn_norm folded in), w2;
    - `pass_biases`: every layer's score biases, stacked (`PassBiases.wave`).
    """

    def __init__(self, model: "Beta12Transformer", finished: bool, length: int, *,
                 traced: bool = False, batched: bool = False) -> None:
        c, kernels = model.config, model.elementwise_kernels
        # Read by a compiled block step (`traced`): gradients by plain autograd, none of the
        # Python-side sums (StackedWeight, BiasRows) that a graph cannot hold.
        project = functools.partial(Projection, head_dim=c.head_dim, kernels=kernels,
                                    accumulate=not traced)
        stack = functools.partial(StackedWeight.of, accumulate=not traced)
        layers = list(model.layers)
        self.layers = len(layers)
        self.plain = [project(layer.attention.input_rows(layer.attention_norm))
                      for layer in (layers[:1] if batched else layers)]
        self.next: Projection | None = None
        self.last_finished: Projection | None = None
        if finished:
            if len(layers) > 1:
                self.next = project([fused_input_rows(layers[l - 1], layers[l])
                                     for l in range(len(layers) - 1, 0, -1)])
            top = layers[-1]
            self.last_finished = project(top.attention.finished_rows(top.attention_norm))
        reverse = layers[::-1]
        self.out = stack([layer.attention.wo.weight for layer in reverse])
        self.gate_up = stack([layer.feed_forward.fused_weight(layer.ffn_norm)
                              for layer in reverse])
        self.down = stack([layer.feed_forward.w2.weight for layer in reverse])
        self.pass_biases = PassBiases(model, length, collect_rows=not traced)

    def index(self, layer: int) -> int:
        """Layer `layer`'s entry in the stacks of every layer (reverse order)."""
        return self.layers - 1 - layer

    def input(self, layer: int, finished: bool) -> Callable[[Tensor, Tensor, Tensor],
                                                             list[Tensor]]:
        """Layer `layer`'s input projection: (normalized, cos, sin) -> its parts."""
        if finished and layer > 0:
            # `next` stacks layers L-1 … 1: layer l is entry L-1-l, as in the other stacks.
            return functools.partial(self.next, index=self.index(layer))
        return self.plain[layer]

    def branches(self, cells: slice) -> BranchWeights:
        """The residual-branch weights of the layers `cells` of the stacks."""
        return BranchWeights(self.out, self.gate_up, self.down, cells)

    def tensors(self) -> list[Tensor]:
        """Every tensor the block step reads of these weights, in a fixed order."""
        projections = [*self.plain, *filter(None, [self.next, self.last_finished])]
        return [t for p in projections for t in p.tensors()] + [
            w.tensor for w in (self.out, self.gate_up, self.down)] + self.pass_biases.tensors()

    def with_tensors(self, tensors: list[Tensor]) -> "PassWeights":
        """These weights reading `tensors` (in `tensors()`'s order) instead, by plain autograd:
        what a captured step reads from fixed addresses (model/step_graphs.py)."""
        it = iter(tensors)
        other = copy.copy(self)
        other.plain = [p.with_tensors(it) for p in self.plain]
        other.next, other.last_finished = (None if p is None else p.with_tensors(it)
                                           for p in (self.next, self.last_finished))
        other.out, other.gate_up, other.down = (StackedWeight(next(it), accumulate=False)
                                                for _ in range(3))
        other.pass_biases = self.pass_biases.with_tensors(it)
        if next(it, None) is not None:
            raise ValueError("PassWeights.with_tensors: more tensors than the weights read")
        return other


class PassBiases:
    """Every layer's score biases (spec §3) for one pass, stacked in reverse layer order as the
    wavefront's weights are (a wave's cells are one strided view): λ per head `[L, H]` (None
    without a depth bias, or with depth_window 0, where every group is the layer's own, offset
    0), b_σ `[L]` (None without a self slot), and the groups' score shifts λ_h·(m - l)
    `[L, G, H]` that the fused kernels take (zero past a layer's groups; float32, float64 for a
    float64 λ), with the pass's gradient rows (`BiasRows`, of `length` tokens: reduced once per
    pass) unless `collect_rows` is off (a compiled step: plain autograd)."""

    def __init__(self, model: "Beta12Transformer", length: int, *, collect_rows: bool) -> None:
        config = model.config
        attentions = [layer.attention for layer in model.layers][::-1]
        sources = [config.source_layers(l) for l in range(len(attentions))]
        self.groups = [len(s) for s in sources]
        width = max(self.groups)
        device = attentions[0].wq.weight.device
        self.slope = (torch.stack([a.depth_slope() for a in attentions])
                      if config.depth_window > 0 and config.depth_bias else None)
        # In λ's precision, at least float32: a float64 model's shifts then equal the eager
        # merge's λ·(m - l) bit for bit (the static step's `cpu_fused` operator reads them).
        dtype = (torch.float32 if self.slope is None
                 else torch.promote_types(self.slope.dtype, torch.float32))
        offsets = torch.tensor([[m - l for m in sources[l]] + [0] * (width - len(sources[l]))
                                for l in range(len(attentions) - 1, -1, -1)],
                               dtype=dtype, device=device)
        self.shift = (offsets[:, :, None] * self.slope.to(dtype)[:, None, :]
                      if self.slope is not None
                      else offsets.new_zeros(*offsets.shape, config.num_heads))
        self.self_bias = (torch.cat([a.self_bias for a in attentions])
                          if attentions[0].self_bias is not None else None)
        self.rows = BiasRows(length, self.groups) if collect_rows else None
        if self.rows is not None:
            self.shift, self.self_bias = self.rows.hand_out_stacks(self.shift, self.self_bias)
        # One WaveBias per kind of wave and pass (eager): every wave's gradient then adds at
        # the views, whose backward (a zero-filled stack each) runs once per kind, not per wave.
        # A traced pass slices inside its graph.
        self._waves: dict[tuple[int, int, int], WaveBias] | None = (
            {} if collect_rows else None)

    def tensors(self) -> list[Tensor]:
        """The stacks every layer's biases are views of (λ, b_σ where present; the shifts)."""
        return [t for t in (self.slope, self.self_bias, self.shift) if t is not None]

    def with_tensors(self, tensors: Iterator[Tensor]) -> "PassBiases":
        """These biases reading the next of `tensors` (in `tensors()`'s order), by plain
        autograd (a captured step's: it collects no gradient rows)."""
        if self.rows is not None:
            raise ValueError("PassBiases.with_tensors: biases that collect gradient rows are "
                             "read by an eager pass, not a captured one")
        other = copy.copy(self)
        other.slope, other.self_bias, other.shift = (None if t is None else next(tensors)
                                                     for t in (self.slope, self.self_bias,
                                                               self.shift))
        return other

    def wave(self, cells: slice) -> WaveBias:
        """The biases of a wave's cells, `cells` of the stacks (wave.Wave.stack)."""
        key = (cells.start, cells.stop, cells.step)
        if self._waves is not None and key in self._waves:
            return self._waves[key]
        bias = WaveBias(None if self.slope is None else self.slope[cells],
                        None if self.self_bias is None else self.self_bias[cells],
                        self.shift[cells], self.rows, cells)
        if self._waves is not None:
            self._waves[key] = bias
        return bias


class Beta12Transformer(DecoderLM):
    """beta_1.2 (spec §1-§4): attention reads finished KVs of layers l … l+k of earlier blocks."""

    beta_extras = True

    def _sources(self) -> list[list[int]]:
        return [self.config.source_layers(l) for l in range(len(self.layers))]

    def forward(self, tokens: Tensor, targets: Tensor | None = None,
                documents: Tensor | None = None) -> Tensor:
        """Logits `[B, T, V]`, or the mean next-token loss when `targets [B, T]` is given;
        `documents [B, T]`: the tokens' document ids (spec §7), None: one document."""
        length = tokens.shape[1]
        self._check_length(length)
        starts = self._document_starts(documents, tokens)
        c = self.config.block_size
        x = self.tok_embeddings(tokens)
        if self.execution.cuda_graphs and self.step_graphs is None:
            raise ConfigError(f"execution.cuda_graphs = true needs a CUDA device; this model is "
                              f"on {x.device}")
        dropout = self.config.dropout if self.training else 0.0
        # A single block reads no history: the block step, eagerly, whatever the schedule.
        schedule = self.schedule if length > c else SCHEDULES["block"]
        padded = -(-length // c) * c if schedule.batched else length
        static = ((self.compiled_step is not None or self.step_graphs is not None)
                  and length > c)
        # Built once per pass, outside the recompute units (which only read them).
        weights = PassWeights(self, finished=length > c, length=padded, traced=static,
                              batched=schedule.batched)
        # The tables of the whole (padded) sequence, once per pass; units read slices.
        cos, sin = self.rope(0, padded, x)
        documents = (None if starts is None
                     else PassDocuments(padded_starts(starts, padded), c))
        history = self._history(x, static=static, documents=documents)
        if static:
            self._prepare_static(history, weights, x, units=schedule.units(self, length))
        try:
            hidden = schedule.run(self, x, cos, sin, weights, history, dropout=dropout,
                                  static=static)
        finally:
            history.close()
        return self.head(hidden, targets)

    def _prepare_static(self, history: BufferedHistory, weights: PassWeights, x: Tensor, *,
                        units: int) -> None:
        """Allocate the history before the first block (the captured steps' own buffers with
        CUDA graphs, which also take this pass's weights for its `units` graphed blocks or
        waves)."""
        c, graphs = self.config, self.step_graphs
        heads, width = c.num_kv_heads, c.head_dim
        buffers = None
        if graphs is not None:
            buffers = graphs.history_buffers(history.shape(x.shape[0], heads, width),
                                             history.dtype, x.device)
            graphs.begin_pass(weights, units=units)
        history.allocate(x.shape[0], heads, width, device=x.device, buffers=buffers)

    def _history(self, x: Tensor, *, static: bool,
                 documents: PassDocuments | None) -> BufferedHistory | PieceHistory:
        """Zero-copy buffers for the backends that read them; per-block pieces for the others
        (and for a single block, which reads no history). `documents`: the pass's document
        starts (None: no mask), which every view hands its block's readers."""
        c, backend, length = self.config, self.attention_backend, x.shape[1]
        if backend.reads_buffers and length > c.block_size:
            return BufferedHistory(self._sources(), c.deep_token_window, length,
                                   dtype=backend.layout.stored_dtype(self._finished_dtype(x)),
                                   check_order=not static, pool=self.history_pool,
                                   documents=documents)
        return PieceHistory(self._sources(), c.deep_token_window, documents)

    def _finished_dtype(self, x: Tensor) -> torch.dtype:
        """The finished keys' dtype: the projections' (under autocast its dtype; RoPE keeps it,
        `layers.apply_rope`)."""
        return autocast_dtype(x.device) or self.layers[0].attention.wq.weight.dtype

    # ---- the static step ------------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        """The order of a training pass's cells (`execution.schedule`, schedule.py)."""
        return SCHEDULES[self.execution.schedule]

    compiled_step: Callable[..., Any] | None = None
    """The schedule's step compiled (`compile_steps`): `run_block`, one graph for every full block,
    or `wavefront.run_wave`, one graph per kind of wave; None: eager."""
    step_graphs: StepGraphs | None = None
    """The schedule's step captured in CUDA graphs per block or wave (`execution.cuda_graphs`,
    on CUDA); None: not."""

    history_pool: BufferPool | None = None
    """The history buffers kept from one pass for the next, on CPU (history.py, "Reuse")."""

    def _select_kernels(self) -> None:
        super()._select_kernels()
        cpu = self.tok_embeddings.weight.device.type == "cpu"
        self.history_pool = BufferPool() if cpu else None
        self.step_graphs = None
        if self.execution.cuda_graphs and self.tok_embeddings.weight.device.type == "cuda":
            self._check_static("execution.cuda_graphs = true")
            self.step_graphs = StepGraphs(CudaCapture())

    def _check_static(self, setting: str) -> None:
        backend, schedule = self.attention_backend, self.schedule
        if not getattr(backend.capabilities, schedule.static_capability):
            raise ConfigError(f"{setting} on the {schedule.name} schedule "
                              f"{schedule.static_needs}; execution.attention = "
                              f"{backend.name!r} does not")

    def parallel_plan(self) -> ParallelPlan:
        """One FSDP unit per layer; compiled: the block or wave step (`compile_steps`)."""
        return ParallelPlan(tuple(self.layers), self.compile_steps)

    def compile_steps(self) -> None:
        """`torch.compile(fullgraph=True)` the schedule's step (`Schedule.compile`): forward,
        and backward (under activation checkpointing, recompute and backward).

        Block schedule: every full block of a sequence through ONE graph of `run_block`. Nothing
        the graph sees differs between blocks but tensor contents: the history is read from
        fixed-size buffers, the block's start from a tensor (`history.HistoryView`), and the
        attention backend must read both (`megabeta::history_attention`: `triton`, or
        `cpu_fused` through attention/merged_op.py). The history's publish stays outside,
        between blocks; a ragged last block runs eagerly (it would be a second graph).

        Wavefront: every wave through `run_wave` compiled, read the same way: one graph per
        kind of wave (its layers, whether a block leaves or enters; `WavePlan.kinds`), shared by
        every wave of that kind, the steady state's p kinds by most of them."""
        self._check_static("execution.compile = true")
        self.compiled_step = self.schedule.compile(self)

    # ---- decoding (spec §4.5) -------------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int | None = None) -> DecodeCache:
        capacity = self._capacity(capacity)
        block, layers = min(self.config.block_size, capacity), len(self.layers)
        return DecodeCache(0, capacity, construction=self._kv_buffers(batch, layers, block),
                           finished=self._kv_buffers(batch, layers, capacity),
                           pending=self._kv_buffers(batch, layers, block))

    @torch.no_grad()
    def extend(self, tokens: Tensor, cache: DecodeCache) -> Tensor:
        cache.reserve(tokens.shape[1])
        c = self.config.block_size
        x = self.tok_embeddings(tokens)
        weights = self.decode_weights(
            cache, lambda: PassWeights(self, finished=True, length=cache.capacity))
        logits = []
        done = 0
        while done < tokens.shape[1]:
            pos = cache.position
            block_start = pos - pos % c
            n = min(block_start + c - pos, tokens.shape[1] - done)
            visible = [buf.view(0, block_start) for buf in cache.finished]
            history = PieceView(self._sources(), self.config.deep_token_window, block_start,
                                   [(k,) for k, _ in visible], [(v,) for _, v in visible],
                                   [buf.view() for buf in cache.construction])
            out = run_block(self, x[:, done:done + n], self.rope(pos, n, x), history, weights,
                            dropout=0.0, finished=True, construction=True)
            for l in range(len(self.layers)):
                cache.construction[l].append(out.construction_k[l], out.construction_v[l])
                cache.pending[l].append(out.finished_k[l], out.finished_v[l])
            cache.position += n
            done += n
            logits.append(self.logits(out.hidden))
            if cache.position % c == 0:
                # The block is complete: its finished KVs become visible, its construction KVs
                # are no longer read by anyone.
                for fin, pend, con in zip(cache.finished, cache.pending, cache.construction):
                    fin.append(*pend.view())
                    pend.clear()
                    con.clear()
        return torch.cat(logits, dim=1)

