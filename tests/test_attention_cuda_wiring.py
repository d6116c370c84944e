"""The `cuda_flash` backend's kernel set (attention/merged.py, `CudaKernels`) without a GPU.

On the meta device the real ATen CUDA ops run as their meta functions: shapes, dtypes, the
argument conventions the schemas fix, and which op serves which part. Numerically the ops are
replaced by float64 stand-ins with the CUDA ops' signatures and output conventions (the
efficient kernel's lse padded to a multiple of 32 with garbage in the padding, its bias checks,
no GQA in the efficient kernel, the backward ops' argument order), and the merge is checked
against one explicit softmax over the whole key set.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from megabeta.model.attention import AttentionBias, GroupBatch, KeySet
from megabeta.model.attention import merged
from megabeta.model.attention.backend import per_query_head
from megabeta.model.attention.merged import (
    CUDA_KERNELS,
    CudaKernels,
    CudaMergedAttention,
    merged_attention,
)
from model_helpers import tiny_model, tokens

B, H, KV, N, D = 2, 4, 2, 5, 8
"""Batch, query heads, key heads (GQA), block length (not a multiple of 32), head size."""
GROUPS = [([1, 2], 7), ([3], 4), ([0], 3)]
"""(depth offsets, rows) per stacked batch of finished groups: two stacked groups, a single
one, and an offset-0 group (a decoding prefix's place)."""
SCALE = 1.0 / math.sqrt(D)

FLASH = "_scaled_dot_product_flash_attention"
EFFICIENT = "_scaled_dot_product_efficient_attention"


def _problem(dtype: torch.dtype, device: str, *, self_bias: bool, depth: bool,
             seed: int = 0) -> dict[str, Any]:
    """Leaf tensors of one block's attention: queries, own keys/values, the groups' keys/values
    per batch, their float32 (float64) gradient buffers, and the biases."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape: int) -> Tensor:
        x = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
        return x.to(device).requires_grad_()

    groups = [(offsets, leaf(len(offsets), B, KV, rows, D), leaf(len(offsets), B, KV, rows, D))
              for offsets, rows in GROUPS]
    buffer = torch.promote_types(dtype, torch.float32)
    return dict(
        q=leaf(B, H, N, D), k=leaf(B, KV, N, D), v=leaf(B, KV, N, D), groups=groups,
        buffers=[(torch.zeros(gk.shape, dtype=buffer, device=device),
                  torch.zeros(gv.shape, dtype=buffer, device=device)) for _, gk, gv in groups],
        slope=leaf(H) if depth else None,
        self_bias=(torch.tensor([0.7], dtype=dtype).to(device).requires_grad_()
                   if self_bias else None))


def _merged(p: dict[str, Any], kernels: CudaKernels) -> Tensor:
    """merged_attention over the problem's parts, the groups as the history hands them over:
    detached views with gradient buffers."""
    batches = [GroupBatch(gk.detach(), gv.detach(), offsets, grads=lambda pair=pair: pair)
               for (offsets, gk, gv), pair in zip(p["groups"], p["buffers"])]
    bias = AttentionBias(slope=p["slope"], self_bias=p["self_bias"])
    return merged_attention(p["q"], p["k"], p["v"], batches, bias, SCALE, kernels=kernels)


class _OpLog(TorchDispatchMode):
    """The attention ops (forward and backward) that ran, counted by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if "attention" in name:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


# --- meta device: the real ops' meta functions ---------------------------------------------


@pytest.mark.parametrize("depth", [True, False], ids=["depth", "no-depth"])
@pytest.mark.parametrize("self_bias", [True, False], ids=["self-bias", "no-self-bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_kernels_on_meta(dtype: torch.dtype, self_bias: bool, depth: bool) -> None:
    p = _problem(dtype, "meta", self_bias=self_bias, depth=depth)
    with _OpLog() as log:
        out = _merged(p, CUDA_KERNELS)
        out.backward(torch.empty_like(out))
    assert out.shape == (B, H, N, D) and out.dtype == dtype
    for name, shape in [("q", (B, H, N, D)), ("k", (B, KV, N, D)), ("v", (B, KV, N, D))]:
        assert p[name].grad.shape == shape and p[name].grad.dtype == dtype, name
    if depth:
        assert p["slope"].grad.shape == (H,) and p["slope"].grad.dtype == dtype
    if self_bias:
        assert p["self_bias"].grad.shape == (1,) and p["self_bias"].grad.dtype == dtype
    for _, gk, _ in p["groups"]:
        assert gk.grad is None  # the groups' gradients go to the buffers, not through autograd

    # Flash takes bf16 (not fp32) and no mask; the efficient kernel the rest.
    own = FLASH if dtype == torch.bfloat16 and not self_bias else EFFICIENT
    group = FLASH if dtype == torch.bfloat16 else EFFICIENT
    expected: Counter[str] = Counter()
    expected[own] += 1
    expected[own + "_backward"] += 1
    expected[group] += len(GROUPS)  # one forward call per stacked batch
    expected[group + "_backward"] += sum(len(offsets) for offsets, _ in GROUPS)  # one per group
    assert log.ops == expected


def test_backend_contract_on_meta() -> None:
    backend = CudaMergedAttention(D)
    assert backend.name == "cuda_flash" and backend.reads_buffers
    assert backend.layout.width == D and backend.kernels is CUDA_KERNELS
    q = torch.empty(B, H, N, D, device="meta", dtype=torch.bfloat16)
    own = torch.empty(B, KV, N, D, device="meta", dtype=torch.bfloat16)
    piece = torch.empty(B, KV, 6, D, device="meta", dtype=torch.bfloat16)
    keys = KeySet(k=own, v=own, finished=[(1, piece, piece), (1, piece, piece), (2, piece, piece)])
    bias = AttentionBias(slope=torch.empty(H, device="meta"),
                         self_bias=torch.empty(1, device="meta"))
    with _OpLog() as log:
        out = backend.attend(q, keys, bias, layer=0, dropout_p=0.0)
    assert out.shape == (B, H, N, D) and out.dtype == torch.bfloat16
    assert log.ops == Counter({EFFICIENT: 1, FLASH: 2})  # own keys; one call per depth offset
    with pytest.raises(ValueError, match="cuda_flash attention has no dropout"):
        backend.attend(q, keys, bias, layer=0, dropout_p=0.1)
    double = dict(dtype=torch.float64, device="meta")
    with pytest.raises(TypeError, match="cuda_flash attention computes in float32"):
        backend.attend(torch.empty(B, H, N, D, **double),
                       KeySet(k=torch.empty(B, KV, N, D, **double),
                              v=torch.empty(B, KV, N, D, **double)),
                       bias, layer=0, dropout_p=0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_model_step_on_meta(dtype: torch.dtype) -> None:
    """A whole model's forward and backward on cuda_flash (the history as buffers, stacked
    groups, several blocks): every parameter gets a gradient, and bf16 takes flash."""
    model = tiny_model(dtype=dtype).to("meta")
    model.attention_backend = CudaMergedAttention(model.attention_backend.layout.head_dim)
    with _OpLog() as log:
        model(tokens().to("meta")).float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert (log.ops[FLASH] > 0) == (dtype == torch.bfloat16) and log.ops[EFFICIENT] > 0


# --- CPU stand-ins for the CUDA ops, in float64 ---------------------------------------------


def _attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool,
               scale: float) -> tuple[Tensor, Tensor]:
    """Output and lse of softmax(q·kᵀ·scale + bias) v, plain math (equal head counts)."""
    scores = _scores(q, k, bias, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def _scores(q: Tensor, k: Tensor, bias: Tensor | None, causal: bool, scale: float) -> Tensor:
    scores = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias
    if causal:
        n, s = scores.shape[-2:]
        assert n == s, "top-left causal only for square scores here"
        scores = scores.masked_fill(torch.ones(n, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores


def _attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                        lse: Tensor, bias: Tensor | None, causal: bool,
                        scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The flash backward's formulas: P from the given lse, D_i = dO_i·o_i from the given out."""
    probs = torch.exp(_scores(q, k, bias, causal, scale) - lse[..., None])
    delta = (grad * out).sum(-1, keepdim=True)
    d_scores = probs * (grad @ v.transpose(-1, -2) - delta)
    return (d_scores @ k * scale, d_scores.transpose(-1, -2) @ q * scale,
            probs.transpose(-1, -2) @ grad)


def flash_stand_in(query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0,
                   is_causal: bool = False, return_debug_mask: bool = False, *,
                   scale: float | None = None) -> tuple[Any, ...]:
    """`aten._scaled_dot_product_flash_attention`: GQA's fewer key heads taken as they are; lse
    `[B, H, n]` unpadded (here in the inputs' float64, where CUDA's is float32)."""
    assert dropout_p == 0.0 and not return_debug_mask
    heads = query.shape[1]
    out, lse = _attention(query, per_query_head(key, heads), per_query_head(value, heads), None,
                          is_causal, scale)
    rng = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
    return (out, lse, None, None, query.shape[2], key.shape[2], *rng,
            torch.empty(0, dtype=query.dtype))


def flash_backward_stand_in(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
                            out: Tensor, logsumexp: Tensor, cum_seq_q: Tensor | None,
                            cum_seq_k: Tensor | None, max_q: int, max_k: int, dropout_p: float,
                            is_causal: bool, philox_seed: Tensor, philox_offset: Tensor, *,
                            scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`aten._scaled_dot_product_flash_attention_backward`; dk, dv per key head."""
    assert cum_seq_q is None and cum_seq_k is None, "a defined cum_seq_q selects varlen"
    assert (max_q, max_k) == (query.shape[2], key.shape[2]) and dropout_p == 0.0
    assert logsumexp.shape == query.shape[:3] and logsumexp.is_contiguous()
    assert isinstance(philox_seed, Tensor) and isinstance(philox_offset, Tensor)
    heads, kv_heads = query.shape[1], key.shape[1]
    dq, dk, dv = _attention_backward(grad_out, query, per_query_head(key, heads),
                                     per_query_head(value, heads), out, logsumexp, None,
                                     is_causal, scale)
    return dq, *(g.unflatten(1, (kv_heads, -1)).sum(2) for g in (dk, dv))


def _check_bias(bias: Tensor, query: Tensor, key: Tensor) -> None:
    """What the CUDA efficient kernel demands of its `attn_bias` (attention.cu)."""
    assert bias.shape == (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    assert bias.dtype == query.dtype, "invalid dtype for bias - should match query's dtype"
    assert bias.stride(-1) == 1 and bias.stride(2) % 16 == 0, "attn_bias is not aligned"


def efficient_stand_in(query: Tensor, key: Tensor, value: Tensor, attn_bias: Tensor | None,
                       compute_log_sumexp: bool, dropout_p: float = 0.0,
                       is_causal: bool = False, *,
                       scale: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`aten._scaled_dot_product_efficient_attention`: equal query and key heads; the lse padded
    to a multiple of 32 rows, the padding garbage."""
    assert compute_log_sumexp and dropout_p == 0.0
    assert key.shape[1] == query.shape[1], "the efficient kernel has no GQA"
    if attn_bias is not None:
        _check_bias(attn_bias, query, key)
    out, lse = _attention(query, key, value, attn_bias, is_causal, scale)
    rows = query.shape[2]
    padded = torch.full((*lse.shape[:2], math.ceil(rows / 32) * 32), 123.0, dtype=lse.dtype)
    padded[..., :rows] = lse
    return out, padded, torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)


def efficient_backward_stand_in(grad_out_: Tensor, query: Tensor, key: Tensor, value: Tensor,
                                attn_bias: Tensor | None, out: Tensor, logsumexp: Tensor,
                                philox_seed: Tensor, philox_offset: Tensor, dropout_p: float,
                                grad_input_mask: list[bool], is_causal: bool = False, *,
                                scale: float | None = None) -> tuple[Any, ...]:
    """`aten._scaled_dot_product_efficient_attention_backward`: reads the padded lse."""
    rows = query.shape[2]
    assert logsumexp.shape[-1] % 32 == 0 and logsumexp.shape[-1] >= rows, "lse not padded"
    assert key.shape[1] == query.shape[1] and dropout_p == 0.0
    assert isinstance(philox_seed, Tensor) and isinstance(philox_offset, Tensor)
    assert list(grad_input_mask) == [True, True, True, False]
    if attn_bias is not None:
        _check_bias(attn_bias, query, key)
    grads = _attention_backward(grad_out_, query, key, value, out, logsumexp[..., :rows],
                                attn_bias, is_causal, scale)
    return *grads, None


STAND_INS = CudaKernels(flash=flash_stand_in, flash_backward=flash_backward_stand_in,
                        efficient=efficient_stand_in,
                        efficient_backward=efficient_backward_stand_in)
"""float64 runs on the efficient kernel throughout (as float32 does on CUDA)."""
KERNEL_SETS = {
    "efficient": STAND_INS,
    # float64 routed to flash as bf16 is: the groups, and the own keys without a self bias.
    "flash": dataclasses.replace(STAND_INS, flash_dtypes=frozenset({torch.float64})),
}


def _reference(p: dict[str, Any]) -> Tensor:
    """One explicit softmax per query over every group's keys (score shifted by -λ_h·offset)
    and the block's own keys (causal, b_σ on the diagonal)."""
    q = p["q"]
    keys, values, scores = [], [], []
    for offsets, gk, gv in p["groups"]:
        for i, offset in enumerate(offsets):
            k_g, v_g = per_query_head(gk[i], H), per_query_head(gv[i], H)
            score = q @ k_g.transpose(-1, -2) * SCALE
            if p["slope"] is not None:
                score = score - p["slope"].view(1, H, 1, 1) * offset
            keys.append(k_g)
            values.append(v_g)
            scores.append(score)
    own = q @ per_query_head(p["k"], H).transpose(-1, -2) * SCALE
    if p["self_bias"] is not None:
        own = own + torch.eye(N, dtype=own.dtype) * p["self_bias"]
    scores.append(own.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf")))
    values.append(per_query_head(p["v"], H))
    return torch.softmax(torch.cat(scores, dim=-1), dim=-1) @ torch.cat(values, dim=2)


def _compare(kernels: CudaKernels, *, self_bias: bool, depth: bool) -> None:
    """merged_attention on `kernels` against `_reference`: output and every gradient."""
    ours = _problem(torch.float64, "cpu", self_bias=self_bias, depth=depth)
    ref = _problem(torch.float64, "cpu", self_bias=self_bias, depth=depth)
    weight = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(5),
                         dtype=torch.float64)
    out = _merged(ours, kernels)
    expected = _reference(ref)
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    close = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, expected, **close)
    for name in ("q", "k", "v", "slope", "self_bias"):
        if ref[name] is not None:
            torch.testing.assert_close(ours[name].grad, ref[name].grad, **close, msg=name)
    for (grad_k, grad_v), (_, gk, gv) in zip(ours["buffers"], ref["groups"]):
        torch.testing.assert_close(grad_k, gk.grad, **close)
        torch.testing.assert_close(grad_v, gv.grad, **close)


@pytest.mark.parametrize("depth", [True, False], ids=["depth", "no-depth"])
@pytest.mark.parametrize("self_bias", [True, False], ids=["self-bias", "no-self-bias"])
@pytest.mark.parametrize("kernels", list(KERNEL_SETS), ids=list(KERNEL_SETS))
def test_stand_ins_match_explicit_attention(kernels: str, self_bias: bool, depth: bool) -> None:
    _compare(KERNEL_SETS[kernels], self_bias=self_bias, depth=depth)


def _own_lse_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                      logsumexp: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
    """A flash backward that ignores the lse it is handed (merged, shifted by the depth bias)
    and uses its own part's."""
    heads = query.shape[1]
    scores = query @ per_query_head(key, heads).transpose(-1, -2) * kwargs["scale"]
    return flash_backward_stand_in(grad_out, query, key, value, out,
                                   torch.logsumexp(scores, -1), *args, **kwargs)


def _ignores_bias(query: Tensor, key: Tensor, value: Tensor, attn_bias: Tensor | None,
                  *args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
    """An efficient kernel that drops its `attn_bias` (b_σ and the causal mask)."""
    return efficient_stand_in(query, key, value, None, *args, **kwargs)


@pytest.mark.parametrize("mutation", ["lse padding read", "lse not padded for backward",
                                      "backward on its own lse", "attn_bias dropped"])
def test_the_comparison_catches_mistakes(mutation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of these slips must fail `_compare` (else the check above proves nothing)."""
    kernels = STAND_INS
    if mutation == "lse padding read":  # the merge takes the lse's last rows, padding included
        monkeypatch.setattr(merged, "_unpad", lambda lse, rows: lse[..., lse.shape[-1] - rows:])
    elif mutation == "lse not padded for backward":
        monkeypatch.setattr(merged, "_pad", lambda lse: lse)
    elif mutation == "backward on its own lse":
        kernels = dataclasses.replace(KERNEL_SETS["flash"], flash_backward=_own_lse_backward)
    else:
        kernels = dataclasses.replace(STAND_INS, efficient=_ignores_bias)
    with pytest.raises(AssertionError):
        _compare(kernels, self_bias=True, depth=True)
