"""Building blocks shared by every arm: RMSNorm, RoPE, SwiGLU and the attention projections.

Parameter names follow the torchtitan layout (`attention.wq`, `feed_forward.w1`, …): checkpoints,
exporters and sharding plans rely on them. Nothing here knows about blocks or parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megabeta.model.config import ModelConfig


class RMSNorm(nn.Module):
    """`x · rsqrt(mean(x²) + eps) · w` over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, start: int, length: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables `[length, head_dim]` of positions `start …` for the rotate-half RoPE.

    Inverse frequencies `theta^(-2i/d_h)`, each repeated for both halves; float64 throughout.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    positions = torch.arange(start, start + length, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x [B, heads, n, d_h]` by the positions whose tables `cos/sin [n, d_h]` were sliced."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class FeedForward(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)` (w1 gate, w3 up, w2 down)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    """The projections of one layer's attention and beta_1.2's per-layer extras (spec §1-§2).

    Produces queries, construction KVs and finished KVs; which keys a query sees is decided by the
    caller (the block loop), so the same module serves every arm.
    """

    def __init__(self, config: ModelConfig, beta_extras: bool) -> None:
        super().__init__()
        d, hd = config.d_model, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.lambda_max = config.lambda_max
        self.wq = nn.Linear(d, config.num_heads * hd, bias=False)
        self.wk = nn.Linear(d, config.num_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, config.num_kv_heads * hd, bias=False)
        self.wo = nn.Linear(config.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.norm_eps) if config.qk_norm else None
        # The beta_1.2 extras start at zero (spec §2-§3): a fresh model's c = T forward is exactly
        # the standard Transformer's.
        enc = beta_extras and config.layer_enc
        self.e_k = nn.Parameter(torch.zeros(config.num_kv_heads * hd)) if enc else None
        self.e_v = nn.Parameter(torch.zeros(config.num_kv_heads * hd)) if enc else None
        self.f_q = nn.Parameter(torch.zeros(config.num_heads * hd)) if enc else None
        has_depth = beta_extras and config.depth_bias
        self.depth_bias = nn.Parameter(torch.zeros(config.num_heads)) if has_depth else None
        # Shape [1], not []: FSDP2 cannot shard 0-d parameters.
        self.self_bias = nn.Parameter(torch.zeros(1)) if beta_extras and config.self_slot else None

    def _heads(self, x: Tensor, heads: int, norm: RMSNorm | None) -> Tensor:
        x = x.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)
        return norm(x) if norm is not None else x

    def query(self, xn: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """`RoPE(N_qk(W_Q·xn + f))` as `[B, H, n, d_h]`; `xn` is the normed layer input."""
        q = self.wq(xn)
        if self.f_q is not None:
            q = q + self.f_q
        return apply_rope(self._heads(q, self.num_heads, self.q_norm), cos, sin)

    def kv(self, xn: Tensor, cos: Tensor, sin: Tensor, finished: bool) -> tuple[Tensor, Tensor]:
        """`proj(x)` of spec §2 as `[B, H_kv, n, d_h]` each.

        Construction KV (`finished=False`): `xn` is this layer's normed input, no encodings.
        Finished KV (`finished=True`): `xn` is this layer's normed OUTPUT, plus `e_K`/`e_V`.
        """
        k, v = self.wk(xn), self.wv(xn)
        if finished and self.e_k is not None:
            k, v = k + self.e_k, v + self.e_v
        k = apply_rope(self._heads(k, self.num_kv_heads, self.k_norm), cos, sin)
        return k, self._heads(v, self.num_kv_heads, None)

    def depth_slope(self) -> Tensor | None:
        """λ_{l,h} = lambda_max · sigmoid(θ_{l,h}) per head, or None without depth bias."""
        if self.depth_bias is None:
            return None
        return self.lambda_max * torch.sigmoid(self.depth_bias)

    def merge_heads(self, o: Tensor) -> Tensor:
        """`[B, H, n, d_h]` → `W_O` applied to the concatenated heads, `[B, n, d]`."""
        return self.wo(o.transpose(1, 2).flatten(2))


class TransformerLayer(nn.Module):
    """Pre-norm residual layer: `a = h + Attn(...)`, `h' = a + SwiGLU(RMSNorm(a))` (spec §1)."""

    def __init__(self, config: ModelConfig, beta_extras: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attention = Attention(config, beta_extras)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.feed_forward = FeedForward(config.d_model, config.hidden_dim)
        self.dropout = nn.Dropout(config.dropout)

    def attention_residual(self, x: Tensor, o: Tensor) -> Tensor:
        """`x + W_O·o` for per-head attention output `o [B, H, n, d_h]`."""
        return x + self.dropout(self.attention.merge_heads(o))

    def mlp_residual(self, a: Tensor) -> Tensor:
        return a + self.dropout(self.feed_forward(self.ffn_norm(a)))
