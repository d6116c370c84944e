"""Beta12Transformer: block-sequential computation of spec §3.

Schedule (spec §5, block-sequential): for each block of c tokens in order, run layers 0 … L-1 on
the block's tokens in parallel; every layer reads the finished KVs of earlier blocks (the
history) for its source layers M(l), plus construction KVs inside the block. When a block has
passed layer m, its finished KV of layer m (layer m's own norm and K/V weights on its OUTPUT,
plus e_K/e_V) is computed once and appended to the history; the last block's are skipped in
training because nobody reads them.

The history is a list of per-block tensors per layer. Each block's key set is concatenated from
it inside the block function, which is the activation-checkpoint unit: in backward the block is
recomputed from its embedding slice and the same history tensors (spec §4.6), so the
concatenations live only while one block (one layer's attention, when recomputing) is processed.
The LM head and loss run after the block loop, in chunks (`DecoderLM.head`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megabeta.model.attention import KeyLayout, KeySet, block_attention
from megabeta.model.cache import DecodeCache
from megabeta.model.transformer import DecoderLM

History = list[tuple[Tensor, ...]]
"""Per layer m, the finished K (or V) pieces covering tokens 0 … start(block)-1, in order."""


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


class Beta12Transformer(DecoderLM):
    """beta_1.2 (spec §1-§4): attention reads finished KVs of layers l … l+k of earlier blocks."""

    beta_extras = True

    @property
    def key_layout(self) -> KeyLayout:
        """Fused attention stores the depth/self columns with the keys (see attention.py)."""
        c = self.config
        return KeyLayout(c.head_dim, depth=c.use_sdpa and c.depth_bias and c.depth_window > 0,
                         self_slot=c.use_sdpa and c.self_slot)

    def _groups(self, layer: int, block_start: int, hist_k: History, hist_v: History
                ) -> list[tuple[int, Tensor, Tensor]]:
        """Finished groups of spec §3 for queries of the block starting at `block_start`, as
        history pieces (concatenated once, by the attention call)."""
        window = self.config.deep_token_window
        groups = []
        for m in self.config.source_layers(layer) if block_start > 0 else ():
            # Deeper groups see only the last w tokens before the block (deep_token_window).
            keep = min(window, block_start) if window > 0 and m > layer else block_start
            groups += [(m - layer, k, v)
                       for k, v in zip(_tail(hist_k[m], keep), _tail(hist_v[m], keep))]
        return groups

    def _block(self, x: Tensor, start: int, block_start: int, hist_k: History, hist_v: History,
               prefix: list[tuple[Tensor, Tensor]] | None, want_finished: bool,
               want_construction: bool) -> tuple:
        """All layers on the tokens `x [B, n, d]` at positions `start …` of one block.

        `prefix` holds per layer the construction KVs of the block's tokens before `start`
        (decoding a partly filled block). Returns (finished K per layer, finished V per layer,
        construction K per layer, construction V per layer, final hidden states); the lists are
        empty unless wanted.
        """
        cos, sin = self.rope(start, x.shape[1], x)
        dropout = self.config.dropout if self.training else 0.0
        layout = self.key_layout
        fin_k, fin_v, con_k, con_v = [], [], [], []
        for l, layer in enumerate(self.layers):
            attn = layer.attention
            xn = layer.attention_norm(x)
            q = attn.query(xn, cos, sin)
            k, v = attn.kv(xn, cos, sin, finished=False)
            k, v = layout.keys(k, l), layout.values(v)
            keys = KeySet(k=k, v=v, finished=self._groups(l, block_start, hist_k, hist_v))
            if prefix is not None:
                keys.prefix_k, keys.prefix_v = prefix[l]
            slope = attn.depth_slope() if layout.depth or not self.config.use_sdpa else None
            # Nested in the block's checkpoint, the attention call is checkpointed on its own: its
            # key set (a copy of the whole history) then lives for one layer at a time when the
            # block is recomputed in backward, not for all L layers at once.
            o = self._run(block_attention, q, keys, layout, slope, attn.self_bias,
                          self.config.use_sdpa, l, dropout)
            x = layer.mlp_residual(layer.attention_residual(x, o))
            if want_construction:
                con_k.append(k)
                con_v.append(v)
            if want_finished:
                fk, fv = attn.kv(layer.attention_norm(x), cos, sin, finished=True)
                fin_k.append(layout.keys(fk, l))
                fin_v.append(layout.values(fv))
        return fin_k, fin_v, con_k, con_v, x

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits `[B, T, V]`, or the mean next-token loss when `targets [B, T]` is given."""
        length = tokens.shape[1]
        self._check_length(length)
        c = self.config.block_size
        x = self.tok_embeddings(tokens)
        hist_k: list[list[Tensor]] = [[] for _ in self.layers]
        hist_v: list[list[Tensor]] = [[] for _ in self.layers]
        hidden = []
        for s in range(0, length, c):
            e = min(s + c, length)
            # Snapshots (tuples) of the history: the recompute must see exactly these pieces.
            fin_k, fin_v, _, _, h = self._run(
                self._block, x[:, s:e], s, s, [tuple(p) for p in hist_k],
                [tuple(p) for p in hist_v], None, e < length, False)
            for l in range(len(self.layers)) if e < length else ():
                hist_k[l].append(fin_k[l])
                hist_v[l].append(fin_v[l])
            hidden.append(h)
        return self.head(torch.cat(hidden, dim=1), targets)

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
        logits = []
        done = 0
        while done < tokens.shape[1]:
            pos = cache.position
            block_start = pos - pos % c
            n = min(block_start + c - pos, tokens.shape[1] - done)
            visible = [buf.view(0, block_start) for buf in cache.finished]
            hist_k = [(k,) for k, _ in visible]
            hist_v = [(v,) for _, v in visible]
            prefix = [buf.view() for buf in cache.construction]
            fin_k, fin_v, con_k, con_v, h = self._block(
                x[:, done:done + n], pos, block_start, hist_k, hist_v, prefix, True, True)
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
