"""Analytic FLOPs of one forward pass, counting what each arm really computes.

Matmuls count 2 FLOPs per multiply-add. Attention counts only the score/value products of keys a
query can see (causal halves are not charged). beta_1.2 adds, per layer and token of every block
that has a successor, one finished K/V projection (spec §2), and its queries see the finished
groups of spec §3. Training (forward + backward) is taken as 3x the forward, the usual MFU
convention: activation-checkpoint recomputation is not counted as useful work.
"""

from __future__ import annotations

from megabeta.model.config import ModelConfig


def _visible_keys_beta12(config: ModelConfig, length: int, layer: int) -> int:
    """Sum over the queries of one sequence of the number of keys each sees at `layer`."""
    c, w = config.block_size, config.deep_token_window
    total = 0
    for start in range(0, length, c):
        n = min(c, length - start)
        history = 0
        for m in config.source_layers(layer):
            history += min(w, start) if w > 0 and m > layer else start
        total += n * history + n * (n + 1) // 2  # finished groups + in-block (with self)
    return total


def dense_flops(config: ModelConfig, length: int, vocab_size: int | None = None) -> int:
    """Weight-matmul FLOPs of one forward pass over one sequence of `length` tokens.

    Projections and SwiGLU of every layer application, the LM head, and for beta_1.2 the finished
    K/V projections of every token outside the last block.
    """
    vocab = vocab_size or config.vocab_size
    d, hd, heads, kv = config.d_model, config.head_dim, config.num_heads, config.num_kv_heads
    projections = 2 * d * hd * (2 * heads + 2 * kv) + 2 * 3 * d * config.hidden_dim
    flops = length * (_layer_applications(config) * projections + 2 * d * vocab)
    if config.arch == "beta12":
        last_block = length - (length - 1) // config.block_size * config.block_size
        flops += config.num_layers * (length - last_block) * 2 * d * hd * 2 * kv
    return flops


def attention_flops(config: ModelConfig, length: int) -> int:
    """Score and value FLOPs (q·k and p·v) over the keys each query can see."""
    per_key = 4 * config.head_dim * config.num_heads
    if config.arch == "beta12":
        return per_key * sum(_visible_keys_beta12(config, length, l)
                             for l in range(config.num_layers))
    return per_key * _layer_applications(config) * length * (length + 1) // 2


def forward_flops(config: ModelConfig, length: int, vocab_size: int | None = None) -> int:
    """FLOPs of one forward pass over one sequence of `length` tokens (batch 1)."""
    return dense_flops(config, length, vocab_size) + attention_flops(config, length)


def _layer_applications(config: ModelConfig) -> int:
    return config.num_layers * (config.loops if config.arch == "looped" else 1)


def training_flops(config: ModelConfig, length: int, vocab_size: int | None = None) -> int:
    """FLOPs of forward + backward for one sequence (3x forward)."""
    return 3 * forward_flops(config, length, vocab_size)
