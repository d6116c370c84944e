"""Beta12Transformer: block-sequential computation of spec §3.

Schedule (spec §5, block-sequential): for each block of c tokens in order, run layers 0 … L-1 on
the block's tokens in parallel; every layer reads the finished KVs of earlier blocks (the
history) for its source layers M(l), plus construction KVs inside the block. When a block has
passed layer m, its finished KV of layer m (layer m's own norm and K/V weights on its OUTPUT,
plus e_K/e_V) is computed once and added to the history; the last block's are skipped in
training because nobody reads them.

The history lives in `history.py`: buffers read without copies for the fused path, per-block
pieces for the explicit path and decoding. One block through all layers is the
activation-checkpoint unit: in backward it is recomputed from its embedding slice and the same
history (spec §4.6). The LM head and loss run after the block loop, in chunks (`DecoderLM.head`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megabeta.model.attention import KeyLayout, block_attention
from megabeta.model.cache import DecodeCache
from megabeta.model.history import (
    BufferedHistory,
    BufferedView,
    PieceHistory,
    PieceView,
)
from megabeta.model.layers import Projection, rms_normalize
from megabeta.model.merged_attention import merges_on
from megabeta.model.transformer import DecoderLM


class CellWeights:
    """The fused weights of one pass (layers.Projection), per layer l:

    - `input(l, finished=True)`: one matmul of layer l's normalized input for layer l-1's
      finished K/V and layer l's queries and construction K/V (5 projections, 2 norm weights
      folded in); `finished=False` (a block whose finished KVs nobody reads) drops the first.
    - `last_finished`: the last layer's finished K/V from the block's final hidden states.
    - `gate_up[l]`: SwiGLU's gate and up projections with ffn_norm folded in.
    - `slopes[l]`: the depth bias's λ per head, None without one (or with depth_window 0, where
      every group is the layer's own, offset 0).
    """

    def __init__(self, model: "Beta12Transformer", finished: bool) -> None:
        c = model.config
        inputs = [layer.attention.input_rows(layer.attention_norm) for layer in model.layers]
        self._plain = [Projection(rows, c.head_dim) for rows in inputs]
        self._finished: list[Projection | None] = []
        self.last_finished: Projection | None = None
        if finished:
            outputs = [layer.attention.finished_rows(layer.attention_norm)
                       for layer in model.layers]
            self._finished = [None] + [Projection([fk] + rows + [fv], c.head_dim)
                                       for (fk, fv), rows in zip(outputs, inputs[1:])]
            self.last_finished = Projection(outputs[-1], c.head_dim)
        self.gate_up = [layer.feed_forward.fused_weight(layer.ffn_norm) for layer in model.layers]
        self.slopes = [layer.attention.depth_slope() if c.depth_window > 0 else None
                       for layer in model.layers]

    def input(self, layer: int, finished: bool) -> Projection:
        return self._finished[layer] if finished and layer > 0 else self._plain[layer]


class Beta12Transformer(DecoderLM):
    """beta_1.2 (spec §1-§4): attention reads finished KVs of layers l … l+k of earlier blocks."""

    beta_extras = True

    def key_layout(self, dropout: float = 0.0) -> KeyLayout:
        """Fused attention off the CPU flash kernels stores the depth/self columns with the keys
        (attention.py); on them the biases are lse shifts (merged_attention.py): no columns."""
        c = self.config
        merged = c.use_sdpa and merges_on(self.tok_embeddings.weight.device, dropout)
        columns = c.use_sdpa and not merged
        return KeyLayout(c.head_dim, depth=columns and c.depth_bias and c.depth_window > 0,
                         self_slot=columns and c.self_slot, merged=merged)

    def _sources(self) -> list[list[int]]:
        return [self.config.source_layers(l) for l in range(len(self.layers))]

    def _block(self, x: Tensor, start: int, history: BufferedView | PieceView,
               weights: CellWeights, layout: KeyLayout, dropout: float, want_finished: bool,
               want_construction: bool) -> tuple:
        """All layers on the tokens `x [B, n, d]` at positions `start …` of one block.

        `history` gives each layer its key set: the finished KVs of earlier blocks and, when
        decoding a partly filled block, the construction KVs of its tokens before `start`.
        `weights` are this pass's fused projections, `layout` its `key_layout(dropout)` (made
        once per pass), `dropout` the attention dropout. Returns (finished K per layer, finished
        V per layer, construction K per layer, construction V per layer, final hidden states);
        the lists are empty unless wanted.

        Layer l-1's finished K/V are projections of its output, which is layer l's input: they
        come out of layer l's input matmul (CellWeights), and the last layer's after the loop.
        """
        cos, sin = self.rope(start, x.shape[1], x)
        eps = self.config.norm_eps
        fin_k, fin_v, con_k, con_v = [], [], [], []
        for l, layer in enumerate(self.layers):
            attn = layer.attention
            parts = weights.input(l, want_finished)(rms_normalize(x, eps), cos, sin)
            if want_finished and l > 0:
                fk, q, k, v, fv = parts
                fin_k.append(layout.keys(fk, l - 1))
                fin_v.append(layout.values(fv))
            else:
                q, k, v = parts
            o = block_attention(q, history.key_set(l, k, v), layout, weights.slopes[l],
                                attn.self_bias, self.config.use_sdpa, l, dropout)
            x = layer.mlp_residual(layer.attention_residual(x, o), weights.gate_up[l])
            if want_construction:
                con_k.append(layout.keys(k, l))
                con_v.append(layout.values(v))
        if want_finished:
            fk, fv = weights.last_finished(rms_normalize(x, eps), cos, sin)
            fin_k.append(layout.keys(fk, len(self.layers) - 1))
            fin_v.append(layout.values(fv))
        return fin_k, fin_v, con_k, con_v, x

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits `[B, T, V]`, or the mean next-token loss when `targets [B, T]` is given."""
        length = tokens.shape[1]
        self._check_length(length)
        c = self.config.block_size
        x = self.tok_embeddings(tokens)
        # Built once per pass, outside the checkpointed blocks (which only read them).
        weights = CellWeights(self, finished=length > c)
        dropout = self.config.dropout if self.training else 0.0
        layout = self.key_layout(dropout)
        history = self._history(length)
        hidden = []
        try:
            # Split, not sliced per block: one concatenation in backward instead of a zero-filled
            # [B, T, d] gradient per block.
            for s, block in zip(range(0, length, c), x.split(c, dim=1)):
                e = min(s + c, length)
                fin_k, fin_v, _, _, h = self._run(self._block, block, s, history.view(s),
                                                  weights, layout, dropout, e < length, False)
                if e < length:
                    history.publish(s, fin_k, fin_v)
                hidden.append(h)
        finally:
            history.close()
        return self.head(torch.cat(hidden, dim=1), targets)

    def _history(self, length: int) -> BufferedHistory | PieceHistory:
        """Zero-copy buffers for the fused path; per-block pieces for the explicit path (and
        for a single block, which reads no history)."""
        c = self.config
        if c.use_sdpa and length > c.block_size:
            return BufferedHistory(self._sources(), c.deep_token_window, length)
        return PieceHistory(self._sources(), c.deep_token_window)

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
        weights = self.decode_weights(cache, lambda: CellWeights(self, finished=True))
        layout = self.key_layout()
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
            # No attention dropout when decoding: the cache holds the dropout-free key layout.
            fin_k, fin_v, con_k, con_v, h = self._block(x[:, done:done + n], pos, history,
                                                        weights, layout, 0.0, True, True)
            for l in range(len(self.layers)):
                cache.construction[l].append(con_k[l], con_v[l])
                cache.pending[l].append(fin_k[l], fin_v[l])
            cache.position += n
            done += n
            logits.append(self.logits(h))
            if cache.position % c == 0:
                # The block is complete: its finished KVs become visible, its construction KVs
                # are no longer read by anyone.
                for fin, pend, con in zip(cache.finished, cache.pending, cache.construction):
                    fin.append(*pend.view())
                    pend.clear()
                    con.clear()
        return torch.cat(logits, dim=1)

