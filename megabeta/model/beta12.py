"""Beta12Transformer: the model of spec §1-§4 and its decoding.

Every layer reads the finished K/V of earlier blocks (the history, model/history.py) for its
source layers M(l), plus construction K/V inside the block. When a block has passed layer m, its
finished K/V of layer m (layer m's own norm and K/V weights on its OUTPUT, plus e_K/e_V) is
computed once and written to the history.

A pass builds its weights once (model/pass_weights.py) and runs the plan of its
`execution.schedule` (model/plan.py: waves at a period, units of waves) through the model's
executor (model/executor.py), which runs the pass's driver (model/passes.py) eagerly, compiled
or as CUDA graphs. A ragged last block is padded to c tokens with zero embeddings, each padding
token a document of its own: causality keeps the padding out of every real token (it follows
them in its block, and the last block's finished K/V are not written), and its outputs are
dropped. The LM head and loss run after, in chunks (`DecoderLM.head`).

Decoding runs the same layer body (model/wave.py) on the new tokens of the current block, one
layer a wave, over a cache in the history's form (model/cache.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megabeta.model.attention.backend import Reads
from megabeta.model.cache import DecodeCache
from megabeta.model.documents import padded_starts
from megabeta.model.history import History
from megabeta.model.layers import autocast_dtype
from megabeta.model.pass_weights import PassWeights
from megabeta.model.passes import Driver
from megabeta.model.plan import Wave, WavePlan
from megabeta.model.transformer import DecoderLM
from megabeta.model.wave import Carried, OwnKeys, run_wave


class Beta12Transformer(DecoderLM):
    """beta_1.2 (spec §1-§4): attention reads finished KVs of layers l … l+k of earlier blocks."""

    beta_extras = True

    def _sources(self) -> list[list[int]]:
        return [self.config.source_layers(l) for l in range(len(self.layers))]

    def forward(self, tokens: Tensor, targets: Tensor | None = None,
                documents: Tensor | None = None) -> Tensor:
        """Logits `[B, T, V]`, or the mean next-token loss when `targets [B, T]` is given;
        `documents [B, T]`: the tokens' document ids (spec §7), None: one document."""
        batch, length = tokens.shape
        self._check_length(length)
        starts = self._document_starts(documents, tokens)
        c = self.config.block_size
        blocks = -(-length // c)
        padded = blocks * c if blocks > 1 else length
        x = self.tok_embeddings(tokens)
        if padded > length:
            x = F.pad(x, (0, 0, 0, padded - length))
            starts = padded_starts(starts, padded)
        compute = autocast_dtype(x.device)
        weights = PassWeights(self.layers, self.config, self.elementwise_kernels,
                              finished=blocks > 1, dtype=compute)
        dtype = compute or self.tok_embeddings.weight.dtype
        grad = torch.is_grad_enabled()
        dropout = self.config.dropout if self.training else 0.0
        layers = len(self.layers)
        plan = WavePlan(blocks, layers, self.executor.period(layers, self.config.depth_window))

        def make_driver(pass_documents: Tensor | None) -> Driver:
            history = None
            if blocks > 1:
                layout = self.attention_backend.layout
                shape = (layers, batch, self.config.num_kv_heads, padded, self.config.head_dim)
                stored = layout.stored_dtype(dtype)
                history = History.empty(self._sources(), self.config.deep_token_window, shape,
                                        stored, x.device,
                                        gradient_dtype=layout.gradient_dtype(stored) if grad
                                        else None, documents=pass_documents)
                if grad:
                    self.attention_backend.prepare(history, self.config.num_heads)
            cos, sin = self.rope(0, padded, x)
            cell = padded // blocks
            return Driver(self.body, plan, self.executor.settings, weights, history,
                          cos.view(blocks, cell, -1), sin.view(blocks, cell, -1), dropout,
                          pass_documents)

        # The block size is in the key: a curriculum (train.block_size_schedule) changes it
        # between passes, and with it the plan a set of graphs was recorded for.
        key = (batch, padded, c, x.dtype, compute, starts is None, grad, dropout)
        hidden = self.executor.run(key, x, weights.tensors(), starts, make_driver)
        return self.head(hidden[:, :length], targets)

    # ---- decoding (spec §4.5) -------------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int | None = None) -> DecodeCache:
        capacity = self._capacity(capacity)
        c = self.config
        block, layers = min(c.block_size, capacity), len(self.layers)
        p = self.tok_embeddings.weight
        dtype = self.attention_backend.layout.stored_dtype(p.dtype)
        history = History.empty(self._sources(), c.deep_token_window,
                                (layers, batch, c.num_kv_heads, capacity, c.head_dim), dtype,
                                p.device)
        construction = (layers, batch, c.num_kv_heads, block, c.head_dim)
        return DecodeCache(0, capacity, p.new_empty(construction), p.new_empty(construction),
                           history=history)

    @torch.no_grad()
    def extend(self, tokens: Tensor, cache: DecodeCache) -> Tensor:
        cache.reserve(tokens.shape[1])
        c, layers = self.config.block_size, len(self.layers)
        x = self.tok_embeddings(tokens)
        weights = self.decode_weights(
            cache, lambda: PassWeights(self.layers, self.config, self.elementwise_kernels,
                                       finished=True))
        logits = []
        done = 0
        while done < tokens.shape[1]:
            position = cache.position
            start = position - position % c
            n = min(start + c - position, tokens.shape[1] - done)
            cos, sin = self.rope(position, n, x)
            own = OwnKeys(cache.construction_k, cache.construction_v, position - start)
            view = cache.history.view(start)
            carried: Carried | None = None
            finished = []
            for layer in range(layers):
                wave = Wave(0, (layer,), layers - 1, layers)
                out = run_wave(self.body, weights, wave, carried,
                               x[:, done:done + n] if layer == 0 else None,
                               Reads((layer,), view), cos[None], sin[None], dropout=0.0,
                               own=own)
                finished += out.finished
                carried = out.carried
            cache.history.write([(position, m) for m in range(layers)],
                                [k for k, _ in finished], [v for _, v in finished])
            cache.position += n
            done += n
            logits.append(self.logits(out.hidden))
        return torch.cat(logits, dim=1)
