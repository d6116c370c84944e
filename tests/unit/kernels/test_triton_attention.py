"""The Triton block-attention kernels (megabeta/kernels/triton_attention.py) against the float64
block attention reference with autograd (support/reference_attention.py: spec §3's key set,
[own keys (causal, self bias on the diagonal) | each group's history rows (score minus its
shift)] in one softmax). Run under
Triton's CPU interpreter here (float32, tiny grids: tiles of 16, so n and T of 20-48 cross them).
"""

import functools
import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable: no Triton kernels to test")

from megabeta.kernels import triton_attention  # noqa: E402
from megabeta.kernels.ops import LaunchCount  # noqa: E402
from support.reference_attention import (  # noqa: E402
    INPUTS,
    block_attention_grads,
    group_rows,
)

L, D = 4, 24
TOL = dict(rtol=2e-5, atol=2e-5)


def _case(*, n: int, start: int, batch: int = 1, heads: int = 4, kv_heads: int = 2, width: int = D,
          length: int = 48, sources: tuple[int, ...] = (1, 2, 3), layer: int = 1,
          window: int = 0, self_bias: bool = True, shift: bool = True, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    hist_k = rand(L, batch, kv_heads, length, width)
    hist_v = rand(L, batch, kv_heads, length, width)
    # Rows >= start are not written yet: garbage that must never reach a result.
    hist_k[:, :, :, start:] = float("nan")
    hist_v[:, :, :, start:] = float("inf")
    return dict(
        # Strided like the model's: a transposed [B, n, H, d] projection.
        q=rand(batch, n, heads, width).transpose(1, 2),
        k=rand(batch, n, kv_heads, width).transpose(1, 2), v=rand(batch, kv_heads, n, width),
        hist_k=hist_k, hist_v=hist_v,
        # A 0-d view into a position table (an offset into its storage), as a caller keeps it.
        start=torch.arange(length + 1)[start], start_value=start,
        shift=(rand(len(sources), heads).abs() if shift
               else torch.zeros(len(sources), heads)),
        self_bias=rand(1) if self_bias else None, sources=list(sources), layer=layer,
        window=window, scale=1 / math.sqrt(width), grad=rand(batch, heads, n, width))


def _reference(c: dict, perturb: str | None = None) -> dict:
    """The shared float64 reference (support/reference_attention.py); `perturb` changes one term,
    for the mutation checks."""
    return block_attention_grads({name: c[name] for name in INPUTS}, c["grad"],
                                 sources=c["sources"], layer=c["layer"], start=c["start_value"],
                                 window=c["window"], scale=c["scale"], perturb=perturb)


def _kwargs(c: dict) -> dict:
    return dict(sources=c["sources"], layer=c["layer"], window=c["window"], scale=c["scale"])


def _kernels(c: dict) -> dict:
    """forward then backward, on gradient buffers that start non-zero (the kernels add)."""
    with LaunchCount() as count:
        out, lse = triton_attention.forward(c["q"], c["k"], c["v"], c["hist_k"], c["hist_v"],
                                            c["start"], c["shift"], c["self_bias"], **_kwargs(c))
    assert count.total == 1
    base_k = torch.full(c["hist_k"].shape, 0.25)
    base_v = torch.full(c["hist_k"].shape, -0.5)
    grad_hist_k, grad_hist_v = base_k.clone(), base_v.clone()
    with LaunchCount() as count:
        dq, dk, dv, d_shift, d_self_bias = triton_attention.backward(
            c["grad"], c["q"], c["k"], c["v"], c["hist_k"], c["hist_v"], out, lse, c["start"],
            c["shift"], c["self_bias"], grad_hist_k, grad_hist_v, **_kwargs(c))
    assert count.total == 1
    return dict(out=out, lse=lse, d_q=dq, d_k=dk, d_v=dv, d_shift=d_shift,
                d_self_bias=d_self_bias, d_hist_k=grad_hist_k - base_k,
                d_hist_v=grad_hist_v - base_v)


@functools.lru_cache(maxsize=None)
def _kernels_of(name: str) -> dict:
    """`_kernels` of a named case, shared by the tests (the interpreter is slow)."""
    return _kernels(_case(**CASES[name]))


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got.double(), want, **TOL)


def _assert_matches(got: dict, want: dict) -> None:
    for name in ("out", "lse", "d_q", "d_k", "d_v", "d_shift", "d_hist_k", "d_hist_v"):
        torch.testing.assert_close(got[name].double(), want[name], **TOL, msg=name)
    if want["d_self_bias"] is None:
        assert got["d_self_bias"].numel() == 0
    else:
        torch.testing.assert_close(got["d_self_bias"].double(), want["d_self_bias"], **TOL)


CASES = {
    # n and the history cross tiles of 16; garbage rows 32..47.
    "tiles": dict(n=20, start=32),
    "ragged": dict(n=5, start=40, batch=2, width=16, shift=False),
    "no_history": dict(n=20, start=0, sources=(), kv_heads=4),
    "first_block_with_groups": dict(n=7, start=0, batch=2, kv_heads=1),
    # Sources 1 and 2 are deeper than layer 0: they read only the last 21 rows.
    "deep_window": dict(n=17, start=37, sources=(0, 1, 2), layer=0, window=21,
                        self_bias=False),
}


@pytest.mark.parametrize("name", CASES)
def test_kernels_match_explicit_attention(name: str) -> None:
    got, want = _kernels_of(name), _reference(_case(**CASES[name]))
    _assert_matches(got, want)
    # The output's storage is [B, n, H, d]: heads merge with a view.
    assert got["out"].transpose(1, 2).is_contiguous()
    assert torch.isfinite(got["d_hist_k"]).all() and torch.isfinite(got["out"]).all()
    # The buffers are untouched outside the groups' rows (`want` is zero there).
    for g in ("d_hist_k", "d_hist_v"):
        assert torch.equal(got[g][want[g] == 0], torch.zeros_like(got[g][want[g] == 0]))


@pytest.mark.parametrize("perturb,case", [("self_bias", "tiles"), ("shift_sign", "tiles"),
                                          ("causal", "tiles"), ("window", "deep_window")])
def test_kernels_differ_from_a_perturbed_reference(perturb: str, case: str) -> None:
    """Mutation checks: the comparison above would catch a wrong bias, sign, mask or window."""
    got = _kernels_of(case)
    _assert_matches(got, _reference(_case(**CASES[case])))
    wrong = _reference(_case(**CASES[case]), perturb)
    assert not _close(got["out"], wrong["out"])
    assert not _close(got["d_q"], wrong["d_q"])


def test_half_precision_inputs() -> None:
    """float16 end to end (accumulated in float32); bfloat16's tl.dot is wrong in the
    interpreter (triton#11584), so it is left to a GPU."""
    c = _case(n=9, start=20, length=24)
    want = _reference(c)
    for name in ("q", "k", "v", "hist_k", "hist_v", "grad"):
        c[name] = c[name].half()
    got = _kernels(c)
    assert got["out"].dtype == got["d_q"].dtype == got["d_k"].dtype == torch.float16
    for name in ("out", "lse", "d_q", "d_k", "d_v", "d_shift", "d_self_bias", "d_hist_k",
                 "d_hist_v"):
        torch.testing.assert_close(got[name].double(), want[name], rtol=5e-3, atol=5e-3,
                                   msg=name)


def test_rejects_sources_that_are_not_a_progression() -> None:
    c = _case(n=3, start=8, sources=(0, 1, 3), layer=0)
    with pytest.raises(ValueError, match="one step"):
        triton_attention.forward(c["q"], c["k"], c["v"], c["hist_k"], c["hist_v"], c["start"],
                                 c["shift"], c["self_bias"], **_kwargs(c))


def _differentiable(c: dict, grad_hist: tuple[torch.Tensor, torch.Tensor], fn=None) -> dict:
    """block_attention's output and gradients (through `fn`, by default eager)."""
    q, k, v = (c[x].detach().clone().requires_grad_() for x in ("q", "k", "v"))
    shift = c["shift"].clone().requires_grad_()
    self_bias = c["self_bias"].clone().requires_grad_()
    anchor = torch.zeros((), requires_grad=True)

    def call(q, k, v, hist_k, hist_v, gk, gv, start, shift, self_bias, anchor):
        return triton_attention.block_attention(q, k, v, hist_k, hist_v, gk, gv, start, shift,
                                                self_bias, anchor=anchor, **_kwargs(c))

    out = (fn or call)(q, k, v, c["hist_k"], c["hist_v"], *grad_hist, c["start"], shift,
                       self_bias, anchor)
    (out * c["grad"]).sum().backward()
    # An ordering edge only: no gradient (no launch) in eager mode; a zero through a compiled
    # graph, which would otherwise drop the edge (ops.anchor_gradient).
    if fn is None:
        assert anchor.grad is None
    else:
        assert anchor.grad is not None and anchor.grad.item() == 0.0
    return dict(out=out.detach(), d_q=q.grad, d_k=k.grad, d_v=v.grad, d_shift=shift.grad,
                d_self_bias=self_bias.grad)


def test_autograd_entry_point_matches_and_adds_into_the_buffers() -> None:
    c = _case(n=12, start=20, batch=2, length=24)
    want = _reference(c)
    grad_hist = (torch.ones(c["hist_k"].shape), torch.ones(c["hist_k"].shape))
    got = _differentiable(c, grad_hist)
    for name, value in got.items():
        torch.testing.assert_close(value.double(), want[name], **TOL, msg=name)
    torch.testing.assert_close(grad_hist[0].double() - 1, want["d_hist_k"], **TOL)
    torch.testing.assert_close(grad_hist[1].double() - 1, want["d_hist_v"], **TOL)


def test_compiles_to_one_graph_for_every_start() -> None:
    """The start is a device value: three blocks, one compiled graph, every one exact."""
    from torch._dynamo.backends.debugging import aot_eager

    graphs = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def call(q, k, v, hist_k, hist_v, gk, gv, start, shift, self_bias, anchor):
        return triton_attention.block_attention(q, k, v, hist_k, hist_v, gk, gv, start, shift,
                                                self_bias, anchor=anchor, sources=[1, 2],
                                                layer=1, window=0, scale=D ** -0.5)

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend=counting)
    for start in (0, 9, 20):
        c = _case(n=6, start=start, length=20, sources=(1, 2), seed=start)
        want = _reference(c)
        buffers = (torch.zeros(c["hist_k"].shape), torch.zeros(c["hist_k"].shape))
        got = _differentiable(c, buffers, compiled)
        for name, value in got.items():
            torch.testing.assert_close(value.double(), want[name], **TOL, msg=name)
        torch.testing.assert_close(buffers[0].double(), want["d_hist_k"], **TOL)
        torch.testing.assert_close(buffers[1].double(), want["d_hist_v"], **TOL)
    assert len(graphs) == 1


def _wave_case(*, blocks: tuple[int, ...], layers: list[int], sources: list[list[int]], n: int,
               window: int, num_layers: int, length: int, seed: int = 3) -> list[dict]:
    """The cells of one wave as block cases sharing one history: cell i at block `blocks[i]`
    and `layers[i]` reading `sources[i]`, whose rows from the cell's start on are garbage."""
    cells = [_case(n=n, start=b * n, sources=tuple(s), layer=l, window=window, length=length,
                   seed=seed + i) for i, (b, l, s) in enumerate(zip(blocks, layers, sources))]
    gen = torch.Generator().manual_seed(seed)
    hist_k = torch.randn(num_layers, 1, 2, length, D, generator=gen)
    hist_v = torch.randn(num_layers, 1, 2, length, D, generator=gen)
    for c in cells:
        for m in c["sources"]:
            hist_k[m, :, :, c["start_value"]:] = float("nan")
            hist_v[m, :, :, c["start_value"]:] = float("inf")
    for c in cells:
        c["hist_k"], c["hist_v"] = hist_k, hist_v
    return cells


def test_a_wave_in_one_launch_is_its_cells_block_by_block() -> None:
    """A wave (spec §5) of three cells on consecutive blocks at layers 4, 2, 0 of a 5-layer
    model with k = 1 (M = {4}, {2, 3}, {0, 1}), GQA and a deep-token window: one forward and
    one backward launch give each cell's outputs and gradients, the history's gradients and the
    bias gradient rows exactly as one block_attention call per cell, and they match the float64
    reference."""
    layers, sources = [4, 2, 0], [[4], [2, 3], [0, 1]]
    cells = _wave_case(blocks=(1, 2, 3), layers=layers, sources=sources, n=9, window=13,
                       num_layers=5, length=40)
    width, length = 2, 40

    def leaves(name: str, stack: bool) -> list[torch.Tensor] | torch.Tensor:
        ts = [c[name].detach().clone() for c in cells]
        return torch.stack(ts).requires_grad_() if stack else [t.requires_grad_() for t in ts]

    shifts = torch.zeros(3, width, 4)
    for i, c in enumerate(cells):
        shifts[i, :len(c["sources"])] = c["shift"]
    self_bias = torch.cat([c["self_bias"] for c in cells])
    hist_k, hist_v = cells[0]["hist_k"], cells[0]["hist_v"]
    start = torch.arange(length + 1)[cells[-1]["start_value"]]

    # One block_attention call per cell.
    q1, k1, v1 = leaves("q", False), leaves("k", False), leaves("v", False)
    grad_1 = (torch.full(hist_k.shape, 0.25), torch.full(hist_k.shape, -0.5))
    rows_1 = torch.zeros(3, width, 1, 4, length), torch.zeros(3, 1, 4, length)
    with LaunchCount() as per_cell:
        outs = [triton_attention.block_attention(
            q1[i], k1[i], v1[i], hist_k, hist_v, *grad_1, torch.arange(length + 1)[c["start_value"]],
            shifts[i, :len(c["sources"])], self_bias[i:i + 1], sources=c["sources"],
            layer=c["layer"], window=c["window"], scale=c["scale"],
            shift_rows=rows_1[0][i, :len(c["sources"])], diag_rows=rows_1[1][i])
            for i, c in enumerate(cells)]
        sum((o * c["grad"]).sum() for o, c in zip(outs, cells)).backward()
    assert per_cell.total == 6

    # The wave: one call.
    q, k, v = leaves("q", True), leaves("k", True), leaves("v", True)
    grad_w = (torch.full(hist_k.shape, 0.25), torch.full(hist_k.shape, -0.5))
    rows_w = torch.zeros(3, width, 1, 4, length), torch.zeros(3, 1, 4, length)
    with LaunchCount() as wave:
        out = triton_attention.wave_attention(
            q, k, v, hist_k, hist_v, *grad_w, start, shifts, self_bias, sources=sources[-1],
            layers=layers, top=4, window=13, scale=cells[0]["scale"], shift_rows=rows_w[0],
            diag_rows=rows_w[1])
        (out * torch.stack([c["grad"] for c in cells])).sum().backward()
    assert wave.by_kernel == {"_forward_kernel": 1, "_backward_kernel": 1}

    assert torch.equal(out.detach(), torch.stack([o.detach() for o in outs]))
    for wave_leaf, cell_leaves in ((q, q1), (k, k1), (v, v1)):
        assert torch.equal(wave_leaf.grad, torch.stack([t.grad for t in cell_leaves]))
    for got, want in zip((*grad_w, *rows_w), (*grad_1, *rows_1)):
        assert torch.equal(got, want)
    # And the float64 reference, cell by cell (the history's gradients summed over cells).
    grad_hist = [torch.zeros(hist_k.shape, dtype=torch.float64) for _ in range(2)]
    for i, c in enumerate(cells):
        want = _reference(c)
        torch.testing.assert_close(out[i].detach().double(), want["out"], **TOL)
        torch.testing.assert_close(q.grad[i].double(), want["d_q"], **TOL)
        torch.testing.assert_close(k.grad[i].double(), want["d_k"], **TOL)
        grad_hist[0] += want["d_hist_k"]
        grad_hist[1] += want["d_hist_v"]
        # The shift's gradient is minus the sum of its rows over batch and position.
        torch.testing.assert_close(-rows_w[0][i, :len(c["sources"])].sum((1, 3)).double(),
                                   want["d_shift"], **TOL)
    torch.testing.assert_close(grad_w[0].double() - 0.25, grad_hist[0], **TOL)
    torch.testing.assert_close(grad_w[1].double() + 0.5, grad_hist[1], **TOL)


def test_wave_geometry_is_checked() -> None:
    """Cells whose layers do not step by one constant, or sources deeper than `top`, are
    refused before any launch."""
    with pytest.raises(ValueError, match="step by one constant"):
        triton_attention.Cells.of([0, 1], [5, 2, 0], 5)
    with pytest.raises(ValueError, match="deeper than top"):
        triton_attention.Cells.of([0, 1], [2, 0], 0)
    cells = triton_attention.Cells.of([0, 1, 2], [6, 3, 0], 7)
    assert [cells.sources(i) for i in range(3)] == [[6, 7], [3, 4, 5], [0, 1, 2]]


def _bounds(*runs: tuple[int, int]) -> torch.Tensor:
    """Document bounds `[n]` (spec §7) from (rows, first position of their document) runs."""
    return torch.cat([torch.full((rows,), first) for rows, first in runs])


# n = 20 queries at 32…51 over history rows 0…31 (tiles of 16). Sample 0: rows 0-6 continue a
# document that began at 20 (history tile 0 wholly below every bound), a document starts at
# row 7 (position 39) with a one-token document at row 12, and rows 13-19 one more; query tile
# 1 (rows 16-19) reads no history at all, and only part of own tile 0. Sample 1: one document
# from position 3 (the boundary inside history tile 0).
DOCUMENTS = torch.stack([_bounds((7, 20), (5, 39), (1, 44), (7, 45)), _bounds((20, 3))])


@pytest.mark.parametrize("window", [0, 21])
def test_document_bounds_mask_keys_and_skip_tiles_below_them(window: int) -> None:
    """Spec §7 in the kernels: outputs and every gradient match the float64 reference with the
    bounds. History tiles wholly below a sample's bounds are skipped, not masked: they hold NaN
    here (a read would poison the output, dQ or the gradient rows through 0·NaN), and their
    gradient rows stay as they were."""
    c = _case(n=20, start=32, batch=2, sources=(1, 2, 3) if window == 0 else (0, 1, 2),
              layer=1 if window == 0 else 0, window=window, seed=5)
    want = block_attention_grads({name: c[name] for name in INPUTS}, c["grad"],
                                 sources=c["sources"], layer=c["layer"], start=32,
                                 window=window, scale=c["scale"], lower=DOCUMENTS)
    want_unmasked = _reference(c)
    # Sample 0's tiles wholly below its smallest bound (20), counted from each group's first
    # row (a deeper source's window starts at 11: its tile 11…26 holds the bound).
    skipped = {m: rows.start + (20 - rows.start) // 16 * 16 for m in c["sources"]
               for rows in [group_rows(m, c["layer"], 32, window)]}
    for name in ("hist_k", "hist_v"):
        c[name] = c[name].clone()
        for m, end in skipped.items():
            c[name][m, 0, :, :end] = float("nan")
    lower = DOCUMENTS.clone()
    with LaunchCount() as count:
        out, lse = triton_attention.forward(c["q"], c["k"], c["v"], c["hist_k"], c["hist_v"],
                                            c["start"], c["shift"], c["self_bias"],
                                            **_kwargs(c), lower=lower)
        base = torch.full(c["hist_k"].shape, 0.25)
        grad_hist_k, grad_hist_v = base.clone(), base.clone()
        dq, dk, dv, d_shift, d_self_bias = triton_attention.backward(
            c["grad"], c["q"], c["k"], c["v"], c["hist_k"], c["hist_v"], out, lse, c["start"],
            c["shift"], c["self_bias"], grad_hist_k, grad_hist_v, **_kwargs(c), lower=lower)
    assert count.total == 2
    got = dict(out=out, lse=lse, d_q=dq, d_k=dk, d_v=dv, d_shift=d_shift,
               d_self_bias=d_self_bias, d_hist_k=grad_hist_k - base,
               d_hist_v=grad_hist_v - base)
    _assert_matches(got, want)
    for m, end in skipped.items():
        for buffer in (grad_hist_k, grad_hist_v):
            assert torch.equal(buffer[m, 0, :, :end], base[m, 0, :, :end])
    # And the mask matters: the reference without it differs.
    assert not _close(out, want_unmasked["out"]) and not _close(dq, want_unmasked["d_q"])
