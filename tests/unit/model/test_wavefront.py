"""The wavefront schedule (model/wavefront.py, spec §5): its plan, and the pass it computes
against the naive reference and the block schedule, gradients included."""

from __future__ import annotations

import copy

import pytest
import torch

from megabeta.model import ConfigError, ExecutionConfig
from megabeta.model.wavefront import WavePlan
from support.model_helpers import ATTENTION, tiny_model, tokens
from reference_beta12 import reference_logits
from test_model_exactness import CASES, T


def wavefront(model: torch.nn.Module, checkpoint: str = "none") -> torch.nn.Module:
    """`model` (a copy) on the wavefront schedule."""
    other = copy.deepcopy(model)
    other.execution = ExecutionConfig(attention=model.execution.attention,
                                      schedule="wavefront", activation_checkpoint=checkpoint)
    return other


def gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: torch.zeros_like(p) if p.grad is None else p.grad
                           for n, p in model.named_parameters()}


@pytest.mark.parametrize("blocks,layers,window", [(1, 3, 2), (5, 3, 0), (6, 4, 1), (7, 20, 2),
                                                  (4, 3, 5), (3, 1, 0)])
def test_plan_runs_every_cell_once_after_what_it_reads(blocks: int, layers: int,
                                                       window: int) -> None:
    """Every (block, layer) cell runs exactly once, after cell (b, l-1) and after every
    finished KV it reads (cells (b-1, m), m ≤ top(l)); the cells of one wave are oldest
    first, on consecutive blocks."""
    plan = WavePlan(blocks, layers, min(window, layers - 1) + 1)
    when: dict[tuple[int, int], int] = {}
    for t in range(plan.waves):
        cells = plan.wave(t).cells
        assert cells, t
        assert [b for b, _ in cells] == list(range(cells[0][0], cells[0][0] + len(cells)))
        for cell in cells:
            assert cell not in when
            when[cell] = t
    assert sorted(when) == [(b, l) for b in range(blocks) for l in range(layers)]
    for (b, l), t in when.items():
        if l > 0:
            assert when[(b, l - 1)] < t
        if b > 0:
            assert when[(b - 1, min(l + window, layers - 1))] < t
    assert plan.waves == (blocks - 1) * plan.period + layers


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("attention", ATTENTION)
def test_wavefront_matches_naive_reference(case: str, attention: str) -> None:
    model = wavefront(tiny_model(attention=attention, **CASES[case]))
    x = tokens(length=T)
    expected = reference_logits(model.state_dict(), model.config, x)
    torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-9)


@pytest.mark.parametrize("case", ["c3_k2", "c3_k0", "c3_kL", "stride2", "deep_token_window",
                                  "qk_norm", "gqa", "mqa_untied", "no_extras"])
@pytest.mark.parametrize("attention", ATTENTION)
def test_wavefront_gradients_equal_the_block_schedule(case: str, attention: str) -> None:
    """Same loss and gradients as the block schedule (float64; the batched matmuls and the
    per-wave gradient sums round differently, by ~1e-16), with and without per-wave
    checkpointing; the recompute changes nothing at all."""
    model = tiny_model(attention=attention, **CASES[case])
    x, y = tokens(length=T), tokens(length=T, seed=2)
    want_loss, want = gradients(model, x, y)
    loss, got = gradients(wavefront(model), x, y)
    loss_ckpt, got_ckpt = gradients(wavefront(model, "wave"), x, y)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-12)
    assert torch.equal(loss_ckpt, loss)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-12, msg=name)
        assert torch.equal(got_ckpt[name], got[name]), name
    assert all(g.abs().sum() > 0 for n, g in got.items() if n.endswith(("e_k", "self_bias")))


@pytest.mark.parametrize("attention", ATTENTION)
def test_one_cell_per_wave_is_the_block_schedule_bit_for_bit(attention: str) -> None:
    """With k ≥ L-1 every wave holds one cell: the same matmuls on the same numbers as the block
    schedule (finished K/V fused into the next layer's input matmul), hence the same bits (full
    blocks; a ragged last block is padded here)."""
    model = tiny_model(attention=attention, block_size=3, depth_window=5)
    x = tokens(length=18)
    assert torch.equal(wavefront(model)(x), model(x))


def test_padding_of_a_ragged_last_block_gets_no_gradient() -> None:
    """The zero embeddings that pad the last block are outside the loss: the embedding gradient
    equals the block schedule's, which never sees them."""
    model = tiny_model(block_size=8)
    x, y = tokens(length=T), tokens(length=T, seed=2)
    _, want = gradients(model, x, y)
    _, got = gradients(wavefront(model), x, y)
    torch.testing.assert_close(got["tok_embeddings.weight"], want["tok_embeddings.weight"],
                               rtol=0, atol=1e-12)


def test_decoding_and_a_single_block_are_unchanged() -> None:
    """The wavefront only reorders a training pass of several blocks: a pass of one block and
    prefill + decoding run the block code."""
    model = wavefront(tiny_model(block_size=4))
    x = tokens(length=T)
    full = model(x)
    logits, cache = model.prefill(x[:, :6])
    steps = [logits] + [model.step(x[:, t], cache)[:, None] for t in range(6, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)
    short = x[:, :4]
    torch.testing.assert_close(model(short), reference_logits(model.state_dict(), model.config,
                                                              short), rtol=0, atol=1e-10)


@pytest.mark.parametrize("settings,message", [
    (dict(schedule="diagonal"), "execution.schedule = 'diagonal'"),
    (dict(schedule="wavefront", activation_checkpoint="block"), "activation_checkpoint = wave"),
    (dict(activation_checkpoint="wave"), "execution.schedule = wavefront"),
    (dict(schedule="wavefront", cuda_graphs=True), "activation_checkpoint = wave"),
])
def test_schedule_settings_are_checked(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ExecutionConfig(**settings)


def test_a_compiled_wavefront_needs_a_backend_that_reads_waves_from_tensors() -> None:
    """`execution.compile` on the wavefront schedule runs a wave's cells through one operator
    call (triton, tests/integration/test_model_triton.py); cpu_fused's static operator takes
    one cell: a clear error that names the way out, at compile time."""
    from megabeta.parallel.wrap import apply_compile

    model = tiny_model(attention="cpu_fused", schedule="wavefront")
    with pytest.raises(ConfigError, match="wavefront schedule .* \\(triton\\).*cpu_fused"):
        apply_compile(model)
    assert model.compiled_step is None


def test_wavefront_under_bf16_autocast_trains_like_the_block_schedule() -> None:
    """Under autocast the batched matmuls compute in bf16 as F.linear does, and the weight
    stacks' gradients stay float32."""
    model = tiny_model(dtype=torch.float32, block_size=3)
    x, y = tokens(length=T), tokens(length=T, seed=2)
    results = []
    for m in (model, wavefront(model)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x, y)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (want_loss, want), (loss, got) = results
    torch.testing.assert_close(loss, want_loss, rtol=1e-2, atol=1e-2)
    for name in want:
        assert got[name].dtype == torch.float32, name
        torch.testing.assert_close(got[name], want[name], rtol=2e-2, atol=2e-3, msg=name)
