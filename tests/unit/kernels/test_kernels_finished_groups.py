"""The finished groups' fused CPU kernels (megabeta/kernels/finished_groups.cpp) against an
explicit float64 attention with autograd, on shapes that cross their tiles (64 queries, 512
keys), with GQA, strided inputs and per-head score shifts."""

from __future__ import annotations

import logging
import os
import platform
import shutil

import pytest
import torch

from megabeta.kernels import finished_groups
from megabeta.model import ConfigError
from support.model_helpers import tiny_model

B, H, H_KV, D, G = 2, 4, 2, 16, 3


def _can_build() -> bool:
    return (platform.machine() == "x86_64" and shutil.which("c++") is not None
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


@pytest.fixture(autouse=True)
def _kernels() -> None:
    if not _can_build():
        pytest.skip("no x86-64 AVX2 CPU with a C++ compiler: the fused kernels are not built")
    # Where they can be built they must be: a silent fallback would hide a broken build.
    assert finished_groups.build()


def _case(n: int, rows: int, dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    # Strided like the model's: queries a transposed [B, n, H, d] projection, the groups a
    # slice of a [L, B, H_kv, T, d] history buffer.
    history_k, history_v = rand(G + 2, B, H_KV, rows + 5, D), rand(G + 2, B, H_KV, rows + 5, D)
    q = rand(B, n, H, D).transpose(1, 2)
    if n == 1:  # a single query's row stride is arbitrary (here 1), never a BLAS ld
        q = q.contiguous().as_strided((B, H, 1, D), (H * D, D, 1, 1))
    return dict(q=q, keys=history_k[1:1 + G, :, :, :rows],
                values=history_v[1:1 + G, :, :, :rows], own_k=rand(B, H, 5, D),
                own_v=rand(B, H, 5, D), shift=rand(G, H).abs(), grad=rand(B, H, n, D))


def _explicit(c: dict, scale: float, lower: torch.Tensor | None = None, first: int = 0) -> dict:
    """Attention over the block's own keys and the groups, concatenated, in float64 autograd:
    group g's scores shifted by -shift[g, h] per row (leaves, so their gradient is the row
    sums), the queries twice (own / groups) to separate their gradient. `lower [B, n]`: the
    groups' rows (at positions from `first`) each query reads from (spec §7)."""
    q_own = c["q"].double().detach().requires_grad_()
    q_groups = c["q"].double().detach().requires_grad_()
    keys = c["keys"].double().detach().requires_grad_()
    values = c["values"].double().detach().requires_grad_()
    n = q_own.shape[2]
    shift = c["shift"].double().view(G, 1, H, 1, 1).expand(G, B, H, n, 1).clone()
    shift.requires_grad_()
    per_q = H // H_KV
    k_groups = keys.repeat_interleave(per_q, dim=2)
    v_groups = values.repeat_interleave(per_q, dim=2)
    scores_own = q_own @ c["own_k"].double().transpose(-1, -2) * scale
    scores_groups = [q_groups @ k_groups[g].transpose(-1, -2) * scale - shift[g]
                     for g in range(G)]
    if lower is not None:
        positions = torch.arange(first, first + keys.shape[3])
        before = positions[None, None, None, :] < lower[:, None, :, None]
        scores_groups = [s.masked_fill(before, float("-inf")) for s in scores_groups]
    scores = torch.cat([scores_own, *scores_groups], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.softmax(scores, dim=-1)
    out = p @ torch.cat([c["own_v"].double(), *v_groups.unbind()], dim=2)
    (out * c["grad"].double()).sum().backward()
    own_scores = scores_own.detach()
    return dict(out=out.detach(), lse=lse.detach(), dq=q_groups.grad, dk=keys.grad,
                dv=values.grad, rows=-shift.grad.squeeze(-1),
                own_lse=torch.logsumexp(own_scores, -1),
                own_out=torch.softmax(own_scores, -1) @ c["own_v"].double())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)],
                         ids=["fp64", "fp32"])
@pytest.mark.parametrize("n,rows", [(1, 9), (5, 7), (70, 600), (64, 512)])
def test_kernels_match_explicit_attention(n: int, rows: int, dtype: torch.dtype,
                                          tol: float) -> None:
    c = _case(n, rows, dtype)
    scale = D ** -0.5
    ref = _explicit(c, scale)

    out, lse = ref["own_out"].to(dtype), ref["own_lse"].to(dtype)
    finished_groups.forward([c["q"]], [c["keys"]], [c["values"]], [c["shift"]], [0], scale,
                            [out], [lse])
    torch.testing.assert_close(out.double(), ref["out"], rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref["lse"], rtol=tol, atol=tol)

    history_dk, history_dv = (torch.zeros(G + 2, B, H_KV, rows + 5, D, dtype=dtype)
                              for _ in range(2))
    dk, dv = history_dk[1:1 + G, :, :, :rows], history_dv[1:1 + G, :, :, :rows]
    dk += 1.0  # the kernel adds to what the buffers hold
    dq = torch.full_like(c["grad"], 2.0)
    rows_sum = torch.zeros(G, B, H, n, dtype=dtype)
    delta = (c["grad"].double() * ref["out"]).sum(-1).to(dtype)
    # Each group's lse: the merged one plus its shift (a stride-0 group dimension is fine).
    lse_g = ref["lse"].to(dtype).expand(G, B, H, n) + c["shift"].view(G, 1, H, 1)
    finished_groups.backward([c["grad"]], [c["q"]], [c["keys"]], [c["values"]], [lse_g], [delta],
                             [0], scale, [dq], [dk], [dv], [rows_sum])
    torch.testing.assert_close(dq.double() - 2.0, ref["dq"], rtol=tol, atol=tol)
    torch.testing.assert_close(dk.double() - 1.0, ref["dk"], rtol=tol, atol=tol)
    torch.testing.assert_close(dv.double(), ref["dv"], rtol=tol, atol=tol)
    torch.testing.assert_close(rows_sum.double(), ref["rows"], rtol=tol, atol=tol)
    # Without key/value gradient buffers the kernel forms dq alone, the same.
    dq_only, empty = torch.full_like(c["grad"], 2.0), torch.empty(0, dtype=dtype)
    finished_groups.backward([c["grad"]], [c["q"]], [c["keys"]], [c["values"]], [lse_g], [delta],
                             [0], scale, [dq_only], [empty], [empty], [empty])
    torch.testing.assert_close(dq_only, dq, rtol=0, atol=0)
    # Rows outside the groups' slice are untouched.
    assert history_dk[0].abs().sum() == 0 and history_dk[:, :, :, rows:].abs().sum() == 0
    assert history_dv[G + 1].abs().sum() == 0


def test_one_call_for_several_query_blocks_equals_one_call_per_stack() -> None:
    """A wave's cells in one call: query blocks of different lengths, each with several stacks
    of groups (of different row counts) or none, give bit for bit what one call per stack
    gives, gradients included."""
    dtype, scale = torch.float32, D ** -0.5
    blocks = [(_case(5, 7, dtype, seed=1), 2), (_case(3, 70, dtype, seed=2), 0),
              (_case(9, 600, dtype, seed=3), 3)]
    items = [(i, c) for i, (c, stacks) in enumerate(blocks) for _ in range(stacks)]

    def run(calls: list[list[int]]) -> list[torch.Tensor]:
        q = [c["q"] for c, _ in blocks]
        grad = [c["grad"] for c, _ in blocks]
        keys = [c["keys"] for _, c in items]
        values = [c["values"] * (1 + j) for j, (_, c) in enumerate(items)]  # stacks differ
        shift = [c["shift"] * j for j, (_, c) in enumerate(items)]
        out = [g.clone() for g in grad]  # stands for the own keys' output
        lse = [torch.zeros(g.shape[:3], dtype=dtype) for g in grad]
        for call in calls:
            finished_groups.forward(q, [keys[j] for j in call], [values[j] for j in call],
                                    [shift[j] for j in call], [items[j][0] for j in call],
                                    scale, out, lse)
        dq = [torch.zeros_like(g) for g in grad]
        dk = [torch.zeros_like(k) for k in keys]
        dv = [torch.zeros_like(k) for k in keys]
        rows = [torch.zeros(G, *grad[i].shape[:3], dtype=dtype) for i, _ in items]
        lse_g = [lse[i].expand(G, *lse[i].shape) + shift[j].view(G, 1, H, 1)
                 for j, (i, _) in enumerate(items)]
        delta = [(g * o).sum(-1) for g, o in zip(grad, out)]
        for call in calls:
            pick = lambda xs: [xs[j] for j in call]  # noqa: E731
            finished_groups.backward(grad, q, pick(keys), pick(values), pick(lse_g), delta,
                                     [items[j][0] for j in call], scale, dq, pick(dk), pick(dv),
                                     pick(rows))
        return out + lse + dq + dk + dv + rows

    together = run([list(range(len(items)))])
    apart = run([[j] for j in range(len(items))])
    for a, b in zip(together, apart, strict=True):
        assert torch.equal(a, b)
    out, dq = together[:3], together[6:9]
    assert torch.equal(out[1], blocks[1][0]["grad"]) and not dq[1].any()  # a block with none
    assert dq[0].abs().sum() > 0 and dq[2].abs().sum() > 0


def test_kernels_refuse_bad_shapes_and_layouts() -> None:
    c = _case(4, 6, torch.float64)
    out, lse = torch.zeros(B, H, 4, D, dtype=torch.float64), torch.zeros(B, H, 4,
                                                                          dtype=torch.float64)
    strided = torch.zeros(*c["keys"].shape[:-1], 2 * D, dtype=torch.float64)[..., ::2]
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        finished_groups.forward([c["q"]], [strided], [c["values"]], [c["shift"]], [0], 1.0,
                                [out], [lse])
    with pytest.raises(RuntimeError, match="dtype"):
        finished_groups.forward([c["q"]], [c["keys"].float()], [c["values"]], [c["shift"]], [0],
                                1.0, [out], [lse])
    with pytest.raises(RuntimeError, match="shift must be"):
        finished_groups.forward([c["q"]], [c["keys"]], [c["values"]], [c["shift"][:, :2]], [0],
                                1.0, [out], [lse])
    with pytest.raises(RuntimeError, match="multiple of H_kv"):
        finished_groups.forward([c["q"]], [c["keys"][:, :1]], [c["values"][:, :1]], [c["shift"]],
                                [0], 1.0, [out], [lse])
    with pytest.raises(RuntimeError, match="lse must be"):
        finished_groups.backward([c["grad"][:, :, :4]], [c["q"]], [c["keys"]], [c["values"]],
                                 [lse], [lse], [0], 1.0, [out], [torch.zeros_like(c["keys"])],
                                 [torch.zeros_like(c["values"])], [torch.empty(0, dtype=lse.dtype)])
    with pytest.raises(RuntimeError, match="non-decreasing"):
        finished_groups.forward([c["q"]], [c["keys"]], [c["values"]], [c["shift"]], [1], 1.0,
                                [out], [lse])


def test_unavailable_kernels_fall_back_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A machine that cannot build the kernels (here: a pretend ARM CPU) says why, once; `auto`
    then selects ATen's kernels (cpu_flash), and asking for cpu_fused is a config error."""
    finished_groups.build.cache_clear()
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    try:
        with caplog.at_level(logging.WARNING, logger=finished_groups.__name__):
            assert not finished_groups.build()
            assert not finished_groups.build()
            assert tiny_model().attention_backend.name == "cpu_flash"
            with pytest.raises(ConfigError, match="execution.attention = 'cpu_fused'.*cpu_flash"):
                tiny_model(attention="cpu_fused")
        warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(warnings) == 1 and "aarch64" in warnings[0].getMessage()
    finally:
        finished_groups.build.cache_clear()
    monkeypatch.undo()
    assert finished_groups.build()
    assert tiny_model().attention_backend.name == "cpu_fused"
    assert finished_groups.supports(torch.float64) and not finished_groups.supports(torch.bfloat16)


def test_ninja_from_the_environment_when_not_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unactivated venv has the `ninja` package's binary off PATH; torch's loader needs it."""
    import ninja

    monkeypatch.setenv("PATH", "/nonexistent")
    finished_groups._put_ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
    assert shutil.which("ninja") is not None


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)],
                         ids=["fp64", "fp32"])
def test_document_bounds_mask_and_skip_per_query_row(dtype: torch.dtype, tol: float) -> None:
    """Spec §7: row r reads the rows at positions >= lower[b, r]. 70 queries (two query tiles)
    over 600 rows from position 100 (two key tiles): bounds inside the first and the second key
    tile, below every row (nothing masked) and past every row (the row reads nothing of the
    groups: its output and lse stay the own keys', no NaN, no gradient)."""
    n, rows, first = 70, 600, 100
    c = _case(n, rows, dtype, seed=4)
    lower = torch.zeros(B, n, dtype=torch.int64)
    lower[0, :20] = 0
    lower[0, 20:50] = 350
    lower[0, 50:] = first + rows  # reads no group row
    lower[1, :] = first + 530  # the second key tile only: the first one is skipped
    lower[1, 64:] = first + 599
    scale = D ** -0.5
    ref = _explicit(c, scale, lower, first)

    out, lse = ref["own_out"].to(dtype), ref["own_lse"].to(dtype)
    bounds = dict(lower=[lower], first=[first])
    finished_groups.forward([c["q"]], [c["keys"]], [c["values"]], [c["shift"]], [0], scale,
                            [out], [lse], **bounds)
    torch.testing.assert_close(out.double(), ref["out"], rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref["lse"], rtol=tol, atol=tol)
    torch.testing.assert_close(out[0, :, 50:].double(), ref["own_out"][0, :, 50:], rtol=tol,
                               atol=tol)

    dk, dv = (torch.zeros(G, B, H_KV, rows, D, dtype=dtype) for _ in range(2))
    dq = torch.zeros_like(c["grad"])
    rows_sum = torch.zeros(G, B, H, n, dtype=dtype)
    delta = (c["grad"].double() * ref["out"]).sum(-1).to(dtype)
    lse_g = ref["lse"].to(dtype).expand(G, B, H, n) + c["shift"].view(G, 1, H, 1)
    finished_groups.backward([c["grad"]], [c["q"]], [c["keys"]], [c["values"]], [lse_g], [delta],
                             [0], scale, [dq], [dk], [dv], [rows_sum], **bounds)
    for got, want in ((dq, ref["dq"]), (dk, ref["dk"]), (dv, ref["dv"]), (rows_sum, ref["rows"])):
        assert not got.isnan().any()
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert dk[:, 1, :, :530].abs().sum() == 0  # rows below every bound of sample 1


def test_document_bounds_are_checked() -> None:
    c = _case(5, 7, torch.float64)
    out, lse = torch.zeros_like(c["q"]), torch.zeros(B, H, 5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="lower"):
        finished_groups.forward([c["q"]], [c["keys"]], [c["values"]], [c["shift"]], [0], 1.0,
                                [out], [lse], lower=[torch.zeros(B, 5)], first=[0])
    with pytest.raises(RuntimeError, match="per stack"):
        finished_groups.forward([c["q"]], [c["keys"]], [c["values"]], [c["shift"]], [0], 1.0,
                                [out], [lse], lower=[torch.zeros(B, 5, dtype=torch.int64)],
                                first=[])
