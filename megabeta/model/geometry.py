"""The shapes a beta12 pass works on, for the analyses that count them without running the model
(model/memory.py, bench/roofline.py): its weight matmuls per (block, layer) and the history rows
each finished group reads."""

from __future__ import annotations

from megabeta.kernels.history_attention import group_rows
from megabeta.model.config import ModelConfig


def matmul_shapes(config: ModelConfig, layer: int, finished: bool) -> list[tuple[int, int]]:
    """(in, out) of the weight matmuls of one layer on one block (model/pass_weights.py: the
    fused input projection with the previous layer's finished K/V, W_O, SwiGLU's gate+up and
    w2, and the last layer's finished K/V of the block's final states). `finished`: the block
    has a successor, so it makes finished K/V (spec §2)."""
    d, hd, heads, kv = config.d_model, config.head_dim, config.num_heads, config.num_kv_heads
    fin = 2 * kv * hd if finished else 0
    shapes = [(d, (heads + 2 * kv) * hd + (fin if layer > 0 else 0)),
              (heads * hd, d), (d, 2 * config.hidden_dim), (config.hidden_dim, d)]
    if finished and layer == config.num_layers - 1:
        shapes.append((d, fin))
    return shapes


def history_rows(config: ModelConfig, layer: int, start: int) -> list[int]:
    """History rows each finished group of `layer` reads for a block at `start` (spec §3)."""
    reads = [group_rows(config.deep_token_window, layer, m, start)
             for m in config.source_layers(layer)]
    return [read.stop - read.start for read in reads]


def blocks(config: ModelConfig, seq_len: int) -> list[tuple[int, int]]:
    """(start, rows) of each block of a sequence of `seq_len` tokens."""
    c = config.block_size
    return [(s, min(c, seq_len - s)) for s in range(0, seq_len, c)]


__all__ = ["blocks", "history_rows", "matmul_shapes"]
