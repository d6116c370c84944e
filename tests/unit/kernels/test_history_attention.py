"""`megabeta::history_attention` (megabeta/kernels/history_attention.py) on every implementation
against the float64 reference with autograd (tests/support/reference_attention.py: spec §3's key
set, own keys causal with b_σ on the diagonal and each group's history rows minus its shift, in
one softmax): the output, the lse and every gradient, the history's included.

The implementations are a parameter of the same tests: "cpu" (the fused C++ kernels, float64
and float32: vectors of 4 and 8 lanes), "triton" under Triton's interpreter (float32, tiles of
16: the cases cross them, and the history splits across programs) and "triton" on a CUDA GPU
(rows marked `gpu`, fp32 and bf16, t19_flash's shapes among them). "cpu" adds the history's
gradients into its buffers in backward; "triton" leaves its readers' rows and forms each
history row's gradient once, after (`triton_attention.history_gradients`): the test runs it
for every block of the history as the pass's driver would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from megabeta.kernels import cpu_attention, history_attention
from megabeta.kernels.ops import LaunchCount
from support.reference_attention import INPUTS, block_attention_grads, group_rows

L = 4


@dataclass(frozen=True)
class Case:
    """One call: `cells` blocks of n queries (the newest at `start`, layers stepping by
    -`period`), reading a `[L, batch, kv_heads, length, width]` history."""

    n: int
    start: int
    batch: int = 1
    heads: int = 4
    kv_heads: int = 2
    width: int = 24
    length: int = 48
    layer: int = 1
    depth: int = 2
    stride: int = 1
    window: int = 0
    self_bias: bool = True
    documents: bool = False
    cells: int = 1
    prefix: int = 0
    """Own keys before the queries (decoding; forward only)."""

    @property
    def layers(self) -> list[int]:
        period = self.depth + 1
        return [self.layer + (self.cells - 1 - i) * period for i in range(self.cells)]

    def sources(self, layer: int) -> list[int]:
        return [m for m in range(layer, min(layer + self.depth, L - 1) + 1, self.stride)]

    def start_of(self, cell: int) -> int:
        return self.start - (self.cells - 1 - cell) * self.n


CASES = {
    # n and the history cross tiles of 16; garbage rows past the block.
    "tiles": Case(n=20, start=20),
    "ragged": Case(n=5, start=40, batch=2, width=16),
    "no_history": Case(n=20, start=0, kv_heads=4, depth=0),
    "first_block_with_groups": Case(n=7, start=0, batch=2, kv_heads=1),
    # Sources 1 and 2 are deeper than layer 0: they read only the last 21 rows.
    "deep_window": Case(n=6, start=36, layer=0, window=21, self_bias=False),
    "stride": Case(n=8, start=32, layer=0, depth=3, stride=2),
    "documents": Case(n=8, start=40, batch=2, documents=True, window=10),
    # A wave: two cells on consecutive blocks, layers 3 and 0 (period 3).
    "wave": Case(n=6, start=30, layer=0, cells=2, documents=True),
    "decode_prefix": Case(n=1, start=24, prefix=5),
    # The CPU kernels' query tiles (32 float32 or 16 float64 lanes) and key tiles (128 keys)
    # crossed, at a width of 64 (whole vectors) and documents.
    "long": Case(n=40, start=160, length=200, width=64, batch=2, documents=True),
    # A width that is not a whole number of vectors (the products' column tails).
    "narrow": Case(n=9, start=18, width=12),
}


def inputs(case: Case, seed: int = 0) -> dict:
    """float64 inputs (bf16-representable: one reference serves every dtype)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).bfloat16().double()

    b, h, kv, d = case.batch, case.heads, case.kv_heads, case.width
    nk = case.n + case.prefix
    hist = (L, b, kv, case.length, d)
    groups = max(len(case.sources(layer)) for layer in case.layers)
    lower = None
    if case.documents:
        # Per sample, each query's document start: one begun mid-history, one mid-block.
        lower = torch.zeros(case.cells, b, case.n, dtype=torch.int64)
        for i in range(case.cells):
            first = case.start_of(i)
            lower[i, 0, :case.n // 2] = first // 2 + 3 if first else 0
            lower[i, 0, case.n // 2:] = first + case.n // 2
    return dict(q=rand(case.cells, b, h, case.n, d), k=rand(case.cells, b, kv, nk, d),
                v=rand(case.cells, b, kv, nk, d), hist_k=rand(*hist), hist_v=rand(*hist),
                shift=rand(case.cells, groups, h).abs(),
                self_bias=rand(case.cells) if case.self_bias else None,
                grad=rand(case.cells, b, h, case.n, d), lower=lower)


def reference(case: Case, x: dict) -> dict:
    """Per cell the float64 reference's output, lse and gradients; the history's summed."""
    want: dict = {}
    for i, layer in enumerate(case.layers):
        sources = case.sources(layer) if case.start_of(i) > 0 else []
        cell = dict(q=x["q"][i], k=x["k"][i], v=x["v"][i], hist_k=x["hist_k"],
                    hist_v=x["hist_v"], shift=x["shift"][i, :len(sources)],
                    self_bias=None if x["self_bias"] is None else x["self_bias"][i:i + 1])
        got = block_attention_grads(cell, x["grad"][i], sources=sources, layer=layer,
                                    start=case.start_of(i), window=case.window,
                                    lower=None if x["lower"] is None else x["lower"][i])
        for name, value in got.items():
            if name in ("d_hist_k", "d_hist_v"):
                want[name] = want.get(name, 0) + value
            else:
                want.setdefault(name, []).append(value)
    out = {name: (None if v[0] is None else torch.stack(v)) if isinstance(v, list) else v
           for name, v in want.items() if name != "d_shift"}
    if out["d_self_bias"] is not None:
        out["d_self_bias"] = out["d_self_bias"].reshape(case.cells)
    out["d_shift"] = torch.stack([torch.cat([g, g.new_zeros(x["shift"].shape[1] - len(g),
                                                            g.shape[1])])
                                  for g in want["d_shift"]])
    return out


def run(case: Case, x: dict, implementation: str, dtype: torch.dtype,
        device: torch.device) -> dict:
    """The operator forward and backward as a backend calls it, then the history's gradients:
    "cpu" adds them into its buffers, "triton" forms them from its readers per block."""
    to = {name: None if t is None else t.to(device, dtype if t.is_floating_point() else t.dtype)
          for name, t in x.items()}
    leaves = {name: to[name].clone().requires_grad_() for name in ("q", "k", "v")}
    # The biases in at least float32, as a pass gives them (`PassWeights`).
    wide = torch.promote_types(dtype, torch.float32)
    shift = x["shift"].to(device, wide).requires_grad_()
    self_bias = (None if x["self_bias"] is None
                 else x["self_bias"].to(device, wide).requires_grad_())
    hist_k, hist_v = to["hist_k"].clone(), to["hist_v"].clone()
    # Rows at and past the newest block are not written yet: garbage that must never reach a
    # result.
    hist_k[:, :, :, case.start:] = float("nan")
    hist_v[:, :, :, case.start:] = float("inf")
    layers = case.layers
    sources = case.sources(layers[-1]) if case.start > 0 else []
    grad_k, grad_v = torch.zeros_like(hist_k), torch.zeros_like(hist_v)
    if implementation == "cpu":
        state = [grad_k, grad_v]
    else:
        from megabeta.kernels import triton_attention

        state = [t.zero_() for t in triton_attention.readers(hist_k, case.heads,
                                                              x["shift"].shape[1])]
    start = torch.arange(case.length + 1, device=device)[case.start]
    out = history_attention.attention(
        leaves["q"], leaves["k"], leaves["v"], hist_k, hist_v, start, shift, self_bias,
        state=state if not case.prefix else [], sources=sources, layers=layers, top=L - 1,
        window=case.window, scale=1 / math.sqrt(case.width), implementation=implementation,
        lower=to["lower"])
    got = dict(out=out.detach())
    if case.prefix:
        return got
    (out * to["grad"]).sum().backward()
    got.update(d_q=leaves["q"].grad, d_k=leaves["k"].grad, d_v=leaves["v"].grad,
               d_shift=shift.grad, d_self_bias=None if self_bias is None else self_bias.grad)
    if implementation == "triton" and sources:
        from megabeta.kernels import triton_attention

        documents = None
        if to["lower"] is not None:
            # The pass's document starts at every position the readers cover.
            documents = torch.zeros(case.batch, case.length, dtype=torch.int64, device=device)
            for i in range(case.cells):
                s = case.start_of(i)
                documents[:, s:s + case.n] = to["lower"][i]
        for block in range(0, case.start, case.n):
            cells = [(block, m) for m in range(L)]
            triton_attention.history_gradients(
                hist_k, hist_v, grad_k, grad_v, state, documents, cells=cells, block=case.n,
                depth=case.depth, stride=case.stride, window=case.window,
                scale=1 / math.sqrt(case.width))
    got.update(d_hist_k=grad_k, d_hist_v=grad_v)
    return got


TOL = {torch.float64: dict(rtol=1e-9, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def assert_matches(case: Case, got: dict, want: dict, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    for name in ("out", "d_q", "d_k", "d_v", "d_shift", "d_hist_k", "d_hist_v"):
        if name not in got:
            continue
        value = got[name]
        if name in ("d_hist_k", "d_hist_v"):
            # Only the rows before the newest block are the history's.
            value, expected = value[:, :, :, :case.start], want[name][:, :, :, :case.start]
        else:
            expected = want[name]
        torch.testing.assert_close(value.double().cpu(), expected, **tol, msg=name)
    if "d_self_bias" in got and want.get("d_self_bias") is not None:
        torch.testing.assert_close(got["d_self_bias"].double().cpu(), want["d_self_bias"],
                                   **tol)


def _rows() -> list:
    rows = []
    if cpu_attention.build():
        rows.append(pytest.param("cpu", torch.float64, "cpu", id="cpu-float64"))
        rows.append(pytest.param("cpu", torch.float32, "cpu", id="cpu-float32"))
    rows.append(pytest.param("triton", torch.float32, "cpu", id="triton-interpreter-float32"))
    for dtype in (torch.float32, torch.bfloat16):
        rows.append(pytest.param("triton", dtype, "cuda", marks=pytest.mark.gpu,
                                 id=f"triton-cuda-{str(dtype)[6:]}"))
    return rows


@pytest.mark.parametrize("implementation,dtype,device", _rows())
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_float64_reference(name: str, implementation: str, dtype: torch.dtype,
                                       device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if implementation == "triton":
        pytest.importorskip("triton")
    case = CASES[name]
    x = inputs(case)
    want = reference(case, x)
    if case.prefix:
        # Decoding: the queries are the block's last; the reference sees every own key.
        got = run(case, x, implementation, dtype, torch.device(device))
        torch.testing.assert_close(got["out"].double().cpu(), want["out"], **TOL[dtype])
        return
    assert_matches(case, run(case, x, implementation, dtype, torch.device(device)), want,
                   dtype)


@pytest.mark.parametrize("name", ["tiles", "documents"])
def test_a_split_history_is_the_one_program_history(name: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward's and dQ's splits of the history (and the history gradients' split of the
    queries) change the summation order only: with one program per query tile (no split,
    no merging launches) the results agree to float32 rounding, and with splits the forward
    and backward each launch their merge."""
    pytest.importorskip("triton")
    from megabeta.kernels import triton_attention

    case = CASES[name]
    x = inputs(case)
    cpu = torch.device("cpu")
    with LaunchCount() as split:
        many = run(case, x, "triton", torch.float32, cpu)
    monkeypatch.setattr(triton_attention, "splits", lambda programs, tiles, sms: 1)
    with LaunchCount() as whole:
        one = run(case, x, "triton", torch.float32, cpu)
    for key in one:
        if one[key] is not None:
            torch.testing.assert_close(many[key], one[key], rtol=1e-5, atol=1e-6, msg=key)
    assert split.by_kernel["_merge_kernel"] == 1 and "_merge_kernel" not in whole.by_kernel
    assert split.by_kernel["_reduce_kernel"] == 1 and "_reduce_kernel" not in whole.by_kernel
    assert split.by_kernel["_forward_kernel"] == whole.by_kernel["_forward_kernel"] == 1


def test_a_t19_flash_cell_fills_twice_the_gpu() -> None:
    """At t19_flash's shapes (c = 32, 8 heads, 3 groups, 16K tokens, micro-batch 1) the
    forward's and dQ's grids hold at least twice an H200's 132 SMs of programs (they held 8),
    and the history gradients' grid too (counted, not run: the tiles a CUDA build takes)."""
    pytest.importorskip("triton")
    from megabeta.kernels import triton_attention

    for backward in (False, True):
        tiles = triton_attention.cuda_tiles(256, torch.bfloat16, backward=backward)
        q_tiles = -(-32 // tiles.block_m)
        programs = q_tiles * 8
        key_tiles = -(-16384 // tiles.block_n) * 3
        s = triton_attention.splits(programs, key_tiles, triton_attention.GPU_SMS)
        assert programs * s >= 2 * triton_attention.GPU_SMS
    tiles = triton_attention.cuda_tiles(256, torch.bfloat16, backward=True)
    keys = 4 * 8 * -(-32 // tiles.block_n)  # a block's 4 layers, 8 KV heads
    s = triton_attention.splits(keys, -(-16384 // tiles.block_m), triton_attention.GPU_SMS)
    assert keys * s >= 2 * triton_attention.GPU_SMS


def test_an_unknown_implementation_is_refused_by_name() -> None:
    q = torch.zeros(1, 1, 2, 3, 8)
    k = torch.zeros(1, 1, 1, 3, 8)
    empty = torch.zeros(0)
    with pytest.raises(ValueError, match=r"no implementation 'nope' \(registered: "):
        history_attention.attention(q, k, k, empty, empty, torch.tensor(0), torch.zeros(1, 0, 2),
                                    state=[], sources=[], layers=[0], top=0, window=0,
                                    scale=1.0, implementation="nope")


def test_group_rows_are_the_references() -> None:
    """The model's rows of a group (`history_attention.group_rows`) are the reference's."""
    for window, layer, source, start in [(0, 1, 2, 20), (7, 1, 2, 20), (7, 1, 1, 20),
                                         (30, 0, 3, 20)]:
        assert history_attention.group_rows(window, layer, source, start) == \
            group_rows(source, layer, start, window)
