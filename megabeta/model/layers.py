"""Building blocks shared by every arm: RMSNorm, RoPE, SwiGLU and the attention projections.

Parameter names follow the torchtitan layout (`attention.wq`, `feed_forward.w1`, …): checkpoints,
exporters and sharding plans rely on them. Nothing here knows about blocks or parallelism.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

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
    rms_normalize: Callable[..., Tensor]
    add_rms_normalize: Callable[..., tuple[Tensor, Tensor]]
    split_heads_rope: Callable[..., tuple[Tensor, Tensor]]
    swiglu: Callable[[Tensor], Tensor]

    @classmethod
    def named(cls, name: str) -> "ElementwiseKernels":
        """The implementation `name` (loaded: triton's imports triton)."""
        elementwise.load(name)
        return cls(name, *(partial(fn, implementation=name) for fn in (
            rms_normalize, add_rms_normalize, split_heads_rope, swiglu)))


TORCH_KERNELS = ElementwiseKernels.named("torch")


AUTOCAST_DEVICE_TYPES = frozenset(
    kind for kind in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla")
    if torch.amp.is_autocast_available(kind))
"""Device types autocast knows, read once: torch.compile (torch 2.11) cannot trace
`torch.amp.is_autocast_available` inside a compiled unit."""


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on `device`, or None when it is off."""
    kind = device.type
    if kind in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def matmul_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype a matmul reading `x` computes in when that is not x's own (autocast; it
    leaves float64 alone), else None: what a norm feeding the matmul writes its rows in."""
    dtype = autocast_dtype(x.device)
    return None if dtype is None or x.dtype == torch.float64 else dtype


class StackedWeight:
    """The weight type of a pass: same-shaped weights `[S, out, in]` (or biases `[S, out]`), built
    once per pass from the parameters in the dtype the pass computes in, and multiplied by many
    calls (every block, wave or loop). A layer's own weight is a stack of one; beta12 stacks every
    layer's in reverse layer order, and a wave's cells multiply by a strided view of the stack.

    Its gradient is formed one of three ways (`gradients`):

    - `"autograd"`: the control arms, whose layers run once per pass, and units traced by
      torch.compile;
    - `"pass"` (beta12 on a GPU): each call's backward keeps its input rows and its
      output-gradient rows (`calls`), and `gradient()` forms the stack's gradient with ONE
      batched matmul over the pass. Per (block, layer) cell that saves a matmul of c rows into
      the float32 gradient and its add (and, under autocast, a cast): at t19_flash's shapes a
      read-modify-write of 30 M float32 numbers per cell, 0.5 TB a 16K-token step, where the
      pass's matmul writes them once;
    - `"call"` (beta12 on a CPU): each call's backward adds its rows' product into the
      gradient at once (one batched matmul a call, `baddbmm_` into the call's view of the
      stack). A CPU pays no launch, and its memory bandwidth is what the pass form spends
      most: concatenating every row of the pass costs about as long as the matmul itself, and
      the rows are most of a pass's memory (model/memory.py). Its calls also multiply an
      odd number of entries one entry at a time (`batched_matmul`).

    By hand, a call whose output takes no part in the loss (the last block's finished K/V)
    never runs backward and adds nothing.
    """

    def __init__(self, stack: Tensor, *, gradients: str = "autograd") -> None:
        if gradients not in WEIGHT_GRADIENTS:
            raise ValueError(f"StackedWeight: gradients must be one of {WEIGHT_GRADIENTS}, "
                             f"got {gradients!r}")
        self.weight = stack
        self.gradients = gradients
        self.calls: list[tuple[slice, Tensor, Tensor]] = []
        """`"pass"`: each call that ran backward, `(entries, inputs [n, M, in], output
        gradients [n, M, out])`."""
        self.sum: Tensor | None = None
        """`"call"`: the gradient of the calls that ran backward so far."""
        self.bias_of: StackedWeight | None = None
        """`"pass"`, for a bias stack: the weight stack whose calls it was added in."""

    @property
    def by_hand(self) -> bool:
        """Whether the pass forms this stack's gradient (`"pass"` or `"call"`), not autograd."""
        return self.gradients != "autograd"

    @property
    def per_entry(self) -> bool:
        """Whether its calls multiply an odd number of entries one entry at a time
        (`batched_matmul`): the CPU kernels' form, `"call"`."""
        return self.gradients == "call"

    @classmethod
    def one(cls, weight: Tensor) -> "StackedWeight":
        """A single weight (`[out, in]`, or a bias `[out]`) as a stack of one (a view), its
        gradient by autograd."""
        return cls(weight.unsqueeze(0))

    def backward_call(self, sel: slice, x: Tensor, dy: Tensor,
                      bias: "StackedWeight | None") -> None:
        """A by-hand call's share of the gradients: entries `sel` read rows `x [n, M, in]` and
        got `dy [n, M, out]` (and `bias`, the call's bias stack, the rows of dy)."""
        if self.gradients == "pass":
            self.calls.append((sel, x, dy))
            if bias is not None:
                bias.bias_of = self
            return
        total = self._total()[sel]
        if total.dtype == x.dtype:
            total.baddbmm_(dy.transpose(1, 2), x)
        else:  # a 16-bit pass sums in float32
            total.add_(torch.bmm(dy.transpose(1, 2), x))
        if bias is not None:
            bias._total()[sel].add_(dy.sum(1))

    def _total(self) -> Tensor:
        """`"call"`: the sum of the calls' products so far (zeros before the first), in
        float32 at least."""
        if self.sum is None:
            self.sum = self.weight.new_zeros(
                self.weight.shape, dtype=torch.promote_types(self.weight.dtype, torch.float32))
        return self.sum

    def forget(self) -> None:
        """Let go of what the calls kept (formed, or a replayed capture's earlier backward)."""
        self.calls.clear()
        self.sum = None

    def _entry_rows(self, which: int) -> list[list[Tensor]]:
        """Per stack entry, the rows its calls kept: inputs (`which=1`) or output gradients (2)."""
        rows: list[list[Tensor]] = [[] for _ in range(len(self.weight))]
        for sel, *kept in self.calls:
            for j, entry in enumerate(range(len(self.weight))[sel]):
                rows[entry].append(kept[which - 1][j])
        return rows

    def gradient(self) -> Tensor | None:
        """The by-hand gradient `[S, out, in]` of the whole stack (None: no call ran backward)."""
        if self.gradients == "call":
            return None if self.sum is None else self.sum.to(self.weight.dtype)
        if not self.calls:
            return None
        inputs, grads = self._entry_rows(1), self._entry_rows(2)
        counts = {sum(len(t) for t in rows) for rows in inputs}
        if len(counts) == 1 and 0 not in counts:
            # Every entry saw as many rows (the usual case): one cat each side, one bmm.
            s = len(self.weight)
            x = torch.cat([t for rows in inputs for t in rows]).view(s, -1, inputs[0][0].shape[-1])
            dy = torch.cat([t for rows in grads for t in rows]).view(s, -1, grads[0][0].shape[-1])
            return torch.bmm(dy.transpose(1, 2), x)
        return torch.stack([
            torch.cat(g).T @ torch.cat(x) if x else self.weight.new_zeros(self.weight.shape[1:])
            for x, g in zip(inputs, grads)])

    def bias_gradient(self) -> Tensor | None:
        """The by-hand gradient `[S, out]` of a bias stack read by calls of another stack
        (`stacked_linear`'s `bias`): the sum of their output-gradient rows."""
        if self.gradients == "call":
            return None if self.sum is None else self.sum.to(self.weight.dtype)
        if self.bias_of is None or not self.bias_of.calls:
            return None
        return torch.stack([torch.cat(g).sum(0) if g else self.weight.new_zeros(self.weight.shape[1:])
                            for g in self.bias_of._entry_rows(2)])


WEIGHT_GRADIENTS = ("autograd", "pass", "call")
"""How a stack's gradient is formed (`StackedWeight`)."""


def stacked_linear(x: Tensor, weight: StackedWeight, sel: slice,
                   bias: StackedWeight | None = None) -> Tensor:
    """`x [n, M, in]` times the transposed weights `sel` of the stack `weight` (n of them), plus
    their biases: `[n, M, out]`, one batched matmul."""
    if weight.by_hand and torch.is_grad_enabled():
        return _ByHandLinear.apply(x, weight.weight, None if bias is None else bias.weight, sel,
                                   weight, bias)
    w = weight.weight[sel].transpose(1, 2)
    if autocast_dtype(x.device) is None:
        x = x.to(w.dtype)
    return batched_matmul(x, w, None if bias is None else bias.weight[sel],
                          per_entry=weight.per_entry)


def batched_matmul(a: Tensor, b: Tensor, bias: Tensor | None = None, *,
                   per_entry: bool = False) -> Tensor:
    """`a [n, M, K] @ b [n, K, N]` (plus `bias [n, N]` on every row): `[n, M, N]`.

    `per_entry` (a by-hand stack of the CPU kernels, `gradients="call"`): ATen's batched
    matmul on a CPU gives each thread whole entries, so n entries not a multiple of the
    threads leave a thread idle at the end (3 entries on 2 threads: 1.3-1.7x the time of one
    matmul per entry, each threaded by BLAS). A wave's stack holds as many entries as it has
    cells, often an odd number; there the entries go one matmul each."""
    n = len(a)
    if (not per_entry or n == 1 or n % torch.get_num_threads() == 0 or a.dtype != b.dtype
            or autocast_dtype(a.device) is not None):
        if bias is None:
            return torch.bmm(a, b)
        return torch.baddbmm(bias.unsqueeze(1), a, b)
    out = a.new_empty(n, a.shape[1], b.shape[2])
    for i in range(n):
        if bias is None:
            torch.mm(a[i], b[i], out=out[i])
        else:
            torch.addmm(bias[i], a[i], b[i], out=out[i])
    return out


def linear(x: Tensor, weight: StackedWeight, bias: StackedWeight | None = None, *,
           index: int = 0) -> Tensor:
    """`F.linear(x, w, b)` for `x [..., in]` and the stacks' layer `index` (w, b)."""
    y = stacked_linear(x.reshape(1, -1, x.shape[-1]), weight, slice(index, index + 1), bias)
    return y.view(*x.shape[:-1], y.shape[-1])


class _ByHandLinear(torch.autograd.Function):
    """`stacked_linear` of a by-hand stack: backward hands the input rows and the output
    gradient's rows to the stack (`StackedWeight.backward_call`) and returns the input's
    gradient only (the pass returns the stacks' gradients, `StackedWeight.gradient`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, stack: Tensor, bias: Tensor | None, sel: slice,
                weight: StackedWeight, stacked_bias: StackedWeight | None) -> Tensor:
        w = stack[sel]
        x = x.to(w.dtype)
        # Kept on ctx, not saved: the rows outlive this call's backward (`calls`), and the
        # pass's explicit backward owns their lifetime.
        ctx.x, ctx.sel, ctx.weight, ctx.bias = x, sel, weight, stacked_bias
        ctx.save_for_backward(w)
        return batched_matmul(x, w.transpose(1, 2), None if bias is None else bias[sel],
                              per_entry=weight.per_entry)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, None, None, None, None, None]:
        (w,) = ctx.saved_tensors
        dy = dy.to(w.dtype)
        # Detached: the stack is shared by every call of the pass, so rows that kept their
        # graph would tie the stack to the graph and the graph to the stack, a cycle through
        # autograd's nodes that Python's collector cannot free (each step's graph would leak).
        ctx.weight.backward_call(ctx.sel, ctx.x.detach(), dy, ctx.bias)
        dx = (batched_matmul(dy, w, per_entry=ctx.weight.per_entry)
              if ctx.needs_input_grad[0] else None)
        del ctx.x
        return dx, None, None, None, None, None


@dataclass(eq=False)
class Rows:
    """Some heads of a projection: weight rows, the norm weight to fold into their columns
    (`scale`), optional bias, per-head norm, and whether RoPE applies (queries and keys) or not
    (values)."""

    weight: Tensor
    scale: Tensor | None
    bias: Tensor | None
    heads: int
    head_norm: RMSNorm | None
    rotary: bool = True


def fused_stack(layers: list[list[tuple[Tensor, Tensor | None]]]) -> Tensor:
    """Per layer, blocks of rows `(weight [r, in], column scale [in] or None)` one under the
    other, the layers stacked: `[S, rows, in]`, each weight times its scale (a norm's weight
    folded in). Built part by part across the layers (one stack and one product a part, a
    scale stacked once however many parts share it), so a pass builds its weights in a number
    of launches that does not grow with L."""
    scales: dict[tuple[int, ...], Tensor] = {}
    pieces = []
    for part in zip(*layers):
        weight = _stacked([w for w, _ in part])
        if part[0][1] is not None:
            key = tuple(id(s) for _, s in part)
            if key not in scales:
                scales[key] = _stacked([s for _, s in part]).unsqueeze(1)
            weight = weight * scales[key]
        pieces.append(weight)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)


class Projection:
    """Several projections of the same normed input as ONE matmul, split into heads.

    A block of c tokens makes many small matmuls; fusing them (and folding the RMSNorm weight
    into the rows: `W·norm(x) = (W·diag(w))·(x·rsqrt(mean(x²)+eps))`) makes one larger matmul,
    one normalization and one RoPE per group of heads. Rows are ordered rotary first; parts come
    back in the order given, each `[B, heads, n, d_h]`. Built once per pass from the
    parameters (in the pass's compute dtype: `dtype`), so autograd takes the weights' gradients
    through it.
    """

    def __init__(self, parts: list[Rows] | list[list[Rows]], head_dim: int,
                 kernels: ElementwiseKernels = TORCH_KERNELS, *,
                 dtype: torch.dtype | None = None) -> None:
        """`parts`: one layer's rows, or several layers' rows of the same layout (a stack, in
        the order given: `index` in a call picks one, a wave reads a view of `weight`)."""
        self.kernels = kernels
        layers: list[list[Rows]] = parts if isinstance(parts[0], list) else [parts]
        first = layers[0]
        rotary = [p for p in first if p.rotary]
        plain = [p for p in first if not p.rotary]
        rank = [first.index(p) for p in rotary + plain]
        ordered = [[layer[i] for i in rank] for layer in layers]
        cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
        self.weight = StackedWeight(cast(fused_stack([[(p.weight, p.scale) for p in order]
                                                      for order in ordered])))
        self.bias = None
        if any(p.bias is not None for p in first):
            # Part by part across the layers, as the weight (one zero row block a part).
            self.bias = StackedWeight(cast(torch.cat([
                first[0].weight.new_zeros(len(layers), len(part[0].weight))
                if part[0].bias is None else _stacked([p.bias for p in part])
                for part in zip(*ordered)], dim=1)))
        self.head_dim = head_dim
        self.rotary_heads = sum(p.heads for p in rotary)
        self.head_norm = None
        """Per-head RMSNorm weights of the rotary heads, `[layers, heads, d_h]` (qk_norm is
        all-or-none)."""
        if any(p.head_norm is not None for p in rotary):
            self.head_norm = _stacked([torch.cat([p.head_norm.weight.expand(p.heads, head_dim)
                                                  for p in order[:len(rotary)]])
                                       for order in ordered])
            self.head_norm_eps = next(p.head_norm.eps for p in rotary if p.head_norm is not None)
        self._plain_heads = [p.heads for p in plain]
        self._rotary_heads = [p.heads for p in rotary]
        self._order = [(rotary + plain).index(p) for p in first]
        """Where each part (in the order given) sits among the rotary-first heads."""

    def tensors(self) -> list[Tensor]:
        """What a call reads: the weight, the bias and the per-head norm (those it has)."""
        bias = None if self.bias is None else self.bias.weight
        return [t for t in (self.weight.weight, bias, self.head_norm) if t is not None]

    def with_tensors(self, tensors: Iterator[Tensor], *, gradients: str) -> "Projection":
        """This projection reading the next of `tensors` (in `tensors()`'s order) instead, its
        stacks' gradients formed by hand or not (`StackedWeight`)."""
        other = copy.copy(self)
        other.weight = StackedWeight(next(tensors), gradients=gradients)
        if self.bias is not None:
            other.bias = StackedWeight(next(tensors), gradients=gradients)
        if self.head_norm is not None:
            other.head_norm = next(tensors)
        return other

    def gradients(self) -> list[Tensor | None]:
        """The by-hand gradients, in `tensors()`'s order (the per-head norm's: by autograd)."""
        grads = [self.weight.gradient()]
        if self.bias is not None:
            grads.append(self.bias.bias_gradient())
        if self.head_norm is not None:
            grads.append(None)
        return grads

    def __call__(self, normalized: Tensor, cos: Tensor, sin: Tensor, *,
                 index: int = 0) -> list[Tensor]:
        """The parts of `normalized [B, n, d]` (already `rms_normalize`d), with RoPE at the
        positions of `cos/sin`, by the stack's layer `index`."""
        head_norm = None if self.head_norm is None else self.head_norm[index][:, None]
        return self.split(linear(normalized, self.weight, self.bias, index=index),
                          cos, sin, head_norm)

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


def _stacked(tensors: list[Tensor]) -> Tensor:
    """Per-layer tensors as a stack: one layer's as a view (no copy), several stacked once."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


class FeedForward(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)` (w1 gate, w3 up, w2 down)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def fused_rows(self, norm: RMSNorm) -> list[tuple[Tensor, Tensor]]:
        """`[w1; w3] · diag(norm.weight)` as `fused_stack` rows: gate and up projections of
        `norm(x)` in one matmul of the normalized `x` (the norm's weight folded into the
        columns)."""
        return [(self.w1.weight, norm.weight), (self.w3.weight, norm.weight)]


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
        w = norm.weight
        return [Rows(self.wq.weight, w, self.f_q, self.num_heads, self.q_norm),
                Rows(self.wk.weight, w, None, self.num_kv_heads, self.k_norm),
                Rows(self.wv.weight, w, None, self.num_kv_heads, None, rotary=False)]

    def finished_rows(self, norm: RMSNorm) -> list[Rows]:
        """Rows of this layer's finished K/V (spec §2): the same norm and K/V weights applied to
        the layer's normed OUTPUT, plus `e_K`/`e_V`."""
        w = norm.weight
        return [Rows(self.wk.weight, w, self.e_k, self.num_kv_heads, self.k_norm),
                Rows(self.wv.weight, w, self.e_v, self.num_kv_heads, None, rotary=False)]

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
    """`feed_forward.fused_rows(ffn_norm)`: gate and up with the norm's weight folded in."""
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

    a, normalized = kernels.add_rms_normalize(
        x, branch(stacked_linear(o, weights.out, sel)), eps, dtype=matmul_dtype(x))
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

    def pass_weights(self) -> "BranchWeights":
        """This layer's branch weights for one pass (fused; gradients by autograd)."""
        return BranchWeights(*(StackedWeight.one(w) for w in (
            self.attention.wo.weight, fused_stack([self.feed_forward.fused_rows(self.ffn_norm)])[0],
            self.feed_forward.w2.weight)), cells=slice(0, 1))
