"""Building blocks shared by every arm: RMSNorm, RoPE, SwiGLU and the attention projections.

Parameter names follow the torchtitan layout (`attention.wq`, `feed_forward.w1`, …): checkpoints,
exporters and sharding plans rely on them. Nothing here knows about blocks or parallelism.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from megabeta.kernels import elementwise
from megabeta.kernels.elementwise import (add_rms_normalize, rms_normalize, split_heads_rope,
                                          swiglu)
from megabeta.model.config import ModelConfig


class RMSNorm(nn.Module):
    """`x · rsqrt(mean(x²) + eps) · w` over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_normalize(x, self.eps) * self.weight


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
    """Rotate `x [B, heads, n, d_h]` by the positions whose tables `cos/sin [n, d_h]` were sliced
    (rotate-half: `x·cos + (-x₂, x₁)·sin`), in x's dtype: `split_heads_rope` with every head
    rotary, reading x as `[B, n, heads·d_h]`, a view where x is laid out so (the heads of a
    projection, and elementwise results of them), else a copy."""
    heads, head_dim = x.shape[1], x.shape[-1]
    return split_heads_rope(x.transpose(1, 2).flatten(2), cos, sin, rotary_heads=heads,
                            head_dim=head_dim)[0]


@dataclass(frozen=True)
class ElementwiseKernels:
    """The elementwise functions of `megabeta.kernels.elementwise` a model runs, bound to one
    implementation, `name`: `torch` or `triton` (`model.elementwise_kernels`, chosen once per
    model by `megabeta.model.elementwise.select_elementwise_kernels`)."""

    name: str
    rms_normalize: Callable[[Tensor, float], Tensor]
    add_rms_normalize: Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]]
    split_heads_rope: Callable[..., tuple[Tensor, Tensor]]
    swiglu: Callable[[Tensor], Tensor]

    @classmethod
    def named(cls, name: str) -> "ElementwiseKernels":
        """The implementation `name` (loaded: triton's imports triton)."""
        elementwise.load(name)
        return cls(name, *(partial(fn, implementation=name) for fn in (
            rms_normalize, add_rms_normalize, split_heads_rope, swiglu)))


TORCH_KERNELS = ElementwiseKernels.named("torch")


class Collector(Protocol):
    """Where the readers of one pass leave a tensor's gradient by hand (a shared weight's sum, a
    bias's rows), for `HandOut` to give autograd once."""

    def collected(self) -> Tensor | None:
        """The gradient left so far (None: nothing), handed over: the collector starts again."""


class HandOut(torch.autograd.Function):
    """Forward: a tensor as is (a view). Backward, after every reader's: what its `Collector`
    gathered, plus what readers returned through autograd. The one hand-out of by-hand
    gradients: the pass's weights (`StackedWeight`), the attention biases' rows and the
    history readers' notification (attention/backend.py)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, collector: Collector) -> Tensor:
        ctx.collector = collector
        ctx.set_materialize_grads(False)
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[Tensor | None, None]:
        collector, ctx.collector = ctx.collector, None
        total = collector.collected()
        if grad is not None:  # a reader that is not by hand (e.g. under autocast)
            total = grad if total is None else total + grad
        return total, None


AUTOCAST_DEVICE_TYPES = frozenset(
    kind for kind in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla")
    if torch.amp.is_autocast_available(kind))
"""Device types autocast knows, read once: torch.compile (torch 2.11) cannot trace
`torch.amp.is_autocast_available` inside a compiled block step."""


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on `device`, or None when it is off."""
    kind = device.type
    if kind in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


class StackedWeight:
    """The weight type of a pass: same-shaped weights, `[n, …]`, built once per pass from the
    parameters and multiplied by many calls (every block, wave or loop). A layer's own weight
    is a stack of one (`one`); the wavefront stacks every layer's in reverse layer order (`of`)
    and each wave multiplies by a strided view of the stack.

    Under autograd each call's weight gradient would be one matmul plus one sum into the
    others (twice the launches a cell needs). `stacked_linear` instead adds it in place, one
    batched product per call, into `grad`, handed to autograd once, when every call's backward
    is done (`HandOut`, which all of them take as input). `accumulate=False`: plain autograd,
    for calls traced by torch.compile (whose graphs cannot hold the Python-side sum)."""

    def __init__(self, stack: Tensor, *, accumulate: bool = True) -> None:
        self.weight = stack
        self.grad: Tensor | None = None
        self._ones: dict[int, Tensor] = {}
        self.accumulates = accumulate and stack.requires_grad and torch.is_grad_enabled()
        self.tensor = HandOut.apply(stack, self) if self.accumulates else stack
        """What the calls read: `weight`, through the node that hands the gradient out."""

    @classmethod
    def one(cls, weight: Tensor, *, accumulate: bool = True) -> "StackedWeight":
        """A single weight (`[out, in]`, or a bias `[out]`) as a stack of one (a view)."""
        return cls(weight.unsqueeze(0), accumulate=accumulate)

    @classmethod
    def of(cls, weights: list[Tensor], *, accumulate: bool = True) -> "StackedWeight":
        """`weights` stacked (one copy per pass)."""
        return cls(torch.stack(weights), accumulate=accumulate)

    def add_rows(self, sel: slice, rows: Tensor) -> None:
        """Add `rows [n, M, out]`, summed over M, to the gradient of the (bias) layers `sel`:
        one batched product with ones, added in place."""
        ones = self._ones.get(rows.shape[1])
        if ones is None:
            ones = self._ones[rows.shape[1]] = rows.new_ones(1, 1, rows.shape[1])
        ones = ones.expand(rows.shape[0], -1, -1)
        if self.grad is None and _whole(sel, len(self.weight)) and rows.dtype == self.weight.dtype:
            self.grad = torch.bmm(ones, rows).squeeze(1)
            return
        grad = self.zero_grad_buffer()[sel]
        if grad.dtype != rows.dtype:
            grad.add_(rows.sum(1))
            return
        grad.unsqueeze(1).baddbmm_(ones, rows)

    def add_product(self, sel: slice, dy: Tensor, x: Tensor) -> None:
        """Add `dyᵀ·x` (`[n, M, out]`, `[n, M, in]`) to the gradient of the layers `sel`."""
        if self.grad is None and _whole(sel, len(self.weight)) and x.dtype == self.weight.dtype:
            self.grad = torch.bmm(dy.transpose(1, 2), x)
            return
        grad = self.zero_grad_buffer()[sel]
        if grad.dtype == x.dtype:
            grad.baddbmm_(dy.transpose(1, 2), x)
        else:
            grad.add_(torch.bmm(dy.transpose(1, 2), x))

    def collected(self) -> Tensor | None:
        total, self.grad, self._ones = self.grad, None, {}
        return total

    def zero_grad_buffer(self) -> Tensor:
        """`grad`, zero-filled on first use."""
        if self.grad is None:
            self.grad = torch.zeros_like(self.weight)
        return self.grad


def _whole(sel: slice, n: int) -> bool:
    return sel.indices(n) == (0, n, 1)


def stacked_linear(x: Tensor, weight: StackedWeight, sel: slice,
                   bias: StackedWeight | None = None) -> Tensor:
    """`x [n, M, in]` times the transposed weights `sel` of the stack `weight` (n of them),
    plus their biases: `[n, M, out]`, one batched matmul."""
    if weight.accumulates and (bias is None or bias.accumulates) and torch.is_grad_enabled():
        return _StackedLinear.apply(x, weight.tensor, None if bias is None else bias.tensor, sel,
                                    weight, bias)
    w = weight.tensor[sel].transpose(1, 2)
    if bias is None:
        return torch.bmm(x, w)
    return torch.baddbmm(bias.tensor[sel].unsqueeze(1), x, w)


def linear(x: Tensor, weight: StackedWeight, bias: StackedWeight | None = None, *,
           index: int = 0) -> Tensor:
    """`F.linear(x, w, b)` for `x [..., in]` and the stacks' layer `index` (w, b)."""
    y = stacked_linear(x.reshape(1, -1, x.shape[-1]), weight, slice(index, index + 1), bias)
    return y.view(*x.shape[:-1], y.shape[-1])


class _StackedLinear(torch.autograd.Function):
    """`stacked_linear` whose weight and bias gradients are added into their stacks' `grad`
    (none returned for them: `HandOut` returns the sums). Under autocast it computes in the
    autocast dtype (as F.linear would), the stacks' gradients staying in theirs."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, stack: Tensor, bias: Tensor | None, sel: slice,
                weight: StackedWeight, stacked_bias: StackedWeight | None) -> Tensor:
        w = stack[sel]
        cast = autocast_dtype(x.device)
        if cast is not None:
            x, w = x.to(cast), w.to(cast)
        ctx.sel, ctx.weight, ctx.bias = sel, weight, stacked_bias
        ctx.save_for_backward(x, w)
        if bias is None:
            return torch.bmm(x, w.transpose(1, 2))
        b = bias[sel].unsqueeze(1)
        return torch.baddbmm(b if cast is None else b.to(cast), x, w.transpose(1, 2))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, None, None, None, None, None]:
        x, w = ctx.saved_tensors
        dy = dy.to(x.dtype)
        ctx.weight.add_product(ctx.sel, dy, x)
        if ctx.bias is not None:
            ctx.bias.add_rows(ctx.sel, dy)
        dx = torch.bmm(dy, w) if ctx.needs_input_grad[0] else None
        return dx, None, None, None, None, None


@dataclass(eq=False)
class Rows:
    """Some heads of a projection: weight rows (norm weight folded in), optional bias, per-head
    norm, and whether RoPE applies (queries and keys) or not (values)."""

    weight: Tensor
    bias: Tensor | None
    heads: int
    head_norm: RMSNorm | None
    rotary: bool = True


class Projection:
    """Several projections of the same normed input as ONE matmul, split into heads.

    A block of c tokens makes many small matmuls; fusing them (and folding the RMSNorm weight
    into the rows: `W·norm(x) = (W·diag(w))·(x·rsqrt(mean(x²)+eps))`) makes one larger matmul,
    one normalization and one RoPE per group of heads. Rows are ordered rotary first; parts come
    back in the order given, each `[B, heads, n, d_h]`. Built once per forward from the
    parameters, so autograd takes the weights' gradients through it.
    """

    def __init__(self, parts: list[Rows] | list[list[Rows]], head_dim: int,
                 kernels: ElementwiseKernels = TORCH_KERNELS, *, accumulate: bool = True) -> None:
        """`parts`: one layer's rows, or several layers' rows of the same layout (a stack, in
        the order given: `index` in a call picks one, a wave reads a view of `weight`)."""
        self.kernels = kernels
        layers: list[list[Rows]] = parts if isinstance(parts[0], list) else [parts]
        first = layers[0]
        rotary = [p for p in first if p.rotary]
        plain = [p for p in first if not p.rotary]
        rank = [first.index(p) for p in rotary + plain]
        ordered = [[layer[i] for i in rank] for layer in layers]
        self.weight = StackedWeight(self._stacked([torch.cat([p.weight for p in order])
                                                   for order in ordered]),
                                    accumulate=accumulate)
        self.bias = None
        if any(p.bias is not None for p in first):
            self.bias = StackedWeight(self._stacked([torch.cat([
                p.weight.new_zeros(len(p.weight)) if p.bias is None else p.bias for p in order])
                for order in ordered]), accumulate=accumulate)
        self.head_dim = head_dim
        self.rotary_heads = sum(p.heads for p in rotary)
        self.head_norm = None
        """Per-head RMSNorm weights of the rotary heads, `[layers, heads, d_h]` (qk_norm is
        all-or-none)."""
        if any(p.head_norm is not None for p in rotary):
            self.head_norm = self._stacked([torch.cat([p.head_norm.weight.expand(p.heads, head_dim)
                                                       for p in order[:len(rotary)]])
                                            for order in ordered])
            self.head_norm_eps = next(p.head_norm.eps for p in rotary if p.head_norm is not None)
        self._plain_heads = [p.heads for p in plain]
        self._rotary_heads = [p.heads for p in rotary]
        self._order = [(rotary + plain).index(p) for p in first]
        """Where each part (in the order given) sits among the rotary-first heads."""

    @staticmethod
    def _stacked(tensors: list[Tensor]) -> Tensor:
        # One layer's as a view (no copy), several stacked once per pass.
        return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)

    def tensors(self) -> list[Tensor]:
        """What a call reads: the weight, the bias and the per-head norm (those it has)."""
        bias = None if self.bias is None else self.bias.tensor
        return [t for t in (self.weight.tensor, bias, self.head_norm) if t is not None]

    def with_tensors(self, tensors: Iterator[Tensor]) -> "Projection":
        """This projection reading the next of `tensors` (in `tensors()`'s order) instead, by
        plain autograd."""
        other = copy.copy(self)
        other.weight = StackedWeight(next(tensors), accumulate=False)
        if self.bias is not None:
            other.bias = StackedWeight(next(tensors), accumulate=False)
        if self.head_norm is not None:
            other.head_norm = next(tensors)
        return other

    def __call__(self, normalized: Tensor, cos: Tensor, sin: Tensor, *,
                 index: int = 0) -> list[Tensor]:
        """The parts of `normalized [B, n, d]` (already `rms_normalize`d), with RoPE at the
        positions of `cos/sin`, by the stack's layer `index`."""
        head_norm = None if self.head_norm is None else self.head_norm[index][:, None]
        return self.split(linear(normalized, self.weight, self.bias, index=index), cos, sin,
                          head_norm)

    def split(self, y: Tensor, cos: Tensor, sin: Tensor,
              head_norm: Tensor | None = None) -> list[Tensor]:
        """The parts of this projection's output `y [B, n, W]`, with RoPE at the positions of
        `cos/sin`; `head_norm`: the per-head norm weights broadcast to the rotary heads
        `[heads, n, d_h]` (default: the first layer's, the same for every token)."""
        d = self.head_dim
        if self.head_norm is None:
            rot, plain = self.kernels.split_heads_rope(y, cos, sin,
                                                       rotary_heads=self.rotary_heads, head_dim=d)
        else:
            # qk_norm: the per-head norm sits between the split and RoPE (torch only).
            head_norm = self.head_norm[0][:, None] if head_norm is None else head_norm
            width = self.rotary_heads * d
            rot, plain = y.split([width, y.shape[-1] - width], dim=-1)
            rot = rot.unflatten(-1, (self.rotary_heads, d)).transpose(1, 2)
            rot = rms_normalize(rot, self.head_norm_eps) * head_norm
            # In y's dtype like every other part (the norm's weights may promote it).
            rot = apply_rope(rot, cos, sin).to(y.dtype)
            plain = plain.unflatten(-1, (-1, d)).transpose(1, 2)
        heads = [*rot.split(self._rotary_heads, dim=1), *plain.split(self._plain_heads, dim=1)]
        return [heads[i] for i in self._order]


class FeedForward(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)` (w1 gate, w3 up, w2 down)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def fused_weight(self, norm: RMSNorm) -> Tensor:
        """`[w1; w3] · diag(norm.weight)`: gate and up projections of `norm(x)` in one matmul
        of the normalized `x` (the norm's weight folded into the columns)."""
        return torch.cat([self.w1.weight, self.w3.weight]) * norm.weight



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

    def input_rows(self, norm: RMSNorm) -> list[Rows]:
        """Rows of the projections taken from this layer's normed input (spec §2): queries
        `N_qk(W_Q·xn + f)` and construction K/V `proj(xn)`, with no encodings."""
        return [Rows(self.wq.weight * norm.weight, self.f_q, self.num_heads, self.q_norm),
                Rows(self.wk.weight * norm.weight, None, self.num_kv_heads, self.k_norm),
                Rows(self.wv.weight * norm.weight, None, self.num_kv_heads, None, rotary=False)]

    def finished_rows(self, norm: RMSNorm) -> list[Rows]:
        """Rows of this layer's finished K/V (spec §2): the same norm and K/V weights applied to
        the layer's normed OUTPUT, plus `e_K`/`e_V`."""
        return [Rows(self.wk.weight * norm.weight, self.e_k, self.num_kv_heads, self.k_norm),
                Rows(self.wv.weight * norm.weight, self.e_v, self.num_kv_heads, None,
                     rotary=False)]

    def depth_slope(self) -> Tensor | None:
        """λ_{l,h} = lambda_max · sigmoid(θ_{l,h}) per head, or None without depth bias."""
        if self.depth_bias is None:
            return None
        return self.lambda_max * torch.sigmoid(self.depth_bias)



@dataclass(frozen=True)
class BranchWeights:
    """The residual-branch weights of some layers for one pass: their entries `cells` in the
    pass's stacks (`TransformerLayer.pass_weights` for one layer; beta12's PassWeights stacks
    every layer's, and a wave's cells read a strided slice)."""

    out: StackedWeight
    """W_O."""
    gate_up: StackedWeight
    """`feed_forward.fused_weight(ffn_norm)`: gate and up with the norm's weight folded in."""
    down: StackedWeight
    """w2."""
    cells: slice
    """The layers' entries in the stacks, one per cell."""


def residual_branches(x: Tensor, o: Tensor, weights: BranchWeights, *,
                      kernels: ElementwiseKernels, eps: float,
                      dropout: float) -> tuple[Tensor, Tensor]:
    """The residual branches of n cells (spec §1), each at its own layer: the stream
    `a = x + W_O·o` after the attention branch, and the SwiGLU branch `w2(silu(w1 n) * w3 n)`
    of `n = rms_normalize(a)`, with residual `dropout`. `x [n, B, c, d]`, the attention's
    output `o [n, B·c, H·d_h]` (heads concatenated). The SwiGLU branch comes back unadded: the
    caller adds it where the next norm reads the sum (`add_rms_normalize`). One block of the
    block schedule, a layer of the control arms and decoding are a stack of one cell
    (`x[None]`), a wave of the wavefront schedule a stack of several."""
    n, batch, c, d = x.shape
    sel = weights.cells

    def branch(delta: Tensor) -> Tensor:
        delta = delta.view(n, batch, c, d)
        # No dropout call at p = 0: in training it would still launch a kernel per branch.
        return F.dropout(delta, dropout) if dropout else delta

    a, normalized = kernels.add_rms_normalize(x, branch(stacked_linear(o, weights.out, sel)), eps)
    gate_up = stacked_linear(normalized.flatten(1, 2), weights.gate_up, sel)
    return a, branch(stacked_linear(kernels.swiglu(gate_up), weights.down, sel))


def fused_input_rows(below: "TransformerLayer", above: "TransformerLayer") -> list[Rows]:
    """Rows of `above`'s input projection (queries, construction K/V) fused with `below`'s
    finished K/V, whose output is `above`'s input (spec §2): finished K, Q, K, V, finished V."""
    fk, fv = below.attention.finished_rows(below.attention_norm)
    return [fk, *above.attention.input_rows(above.attention_norm), fv]


class TransformerLayer(nn.Module):
    """Pre-norm residual layer: `a = h + Attn(...)`, `h' = a + SwiGLU(RMSNorm(a))` (spec §1)."""

    def __init__(self, config: ModelConfig, beta_extras: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attention = Attention(config, beta_extras)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.feed_forward = FeedForward(config.d_model, config.hidden_dim)

    def pass_weights(self, *, accumulate: bool = True) -> "BranchWeights":
        """This layer's branch weights for one pass (fused, shared by the pass's calls;
        `accumulate` as in `StackedWeight`)."""
        return BranchWeights(*(StackedWeight.one(w, accumulate=accumulate) for w in (
            self.attention.wo.weight, self.feed_forward.fused_weight(self.ffn_norm),
            self.feed_forward.w2.weight)), cells=slice(0, 1))
