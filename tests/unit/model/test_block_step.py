"""The static block step (`Beta12Transformer.compile_steps`): one compiled graph serves
every full block of a sequence, and computes what the eager block loop computes (which the
exactness tests hold to the naive reference), gradients included."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from megabeta.model import ConfigError, build_model, ExecutionConfig
from megabeta.model.block_schedule import run_block
from megabeta.model.attention import merged_op  # noqa: F401  (registers "cpu_fused")
from megabeta.kernels import finished_groups
from megabeta.parallel.wrap import apply_compile

from support.compile_counts import assert_graphs, fresh_dynamo
from support.model_helpers import assert_trains_like, randomise, tiny_config, tiny_model, tokens

pytestmark = pytest.mark.skipif(not finished_groups.build(),
                                reason="the fused C++ kernels do not build on this machine")


# Each compiles the block step (10-15 s on 2 cores): make test-fast keeps one.
@pytest.mark.parametrize("dtype,checkpoint,flags,traced_at", [
    pytest.param(torch.float64, "block", dict(num_kv_heads=2), 0, marks=pytest.mark.slow),
    (torch.float32, "none", dict(deep_token_window=6, depth_window=1), 4),
    pytest.param(torch.float64, "block", dict(qk_norm=True), 0, marks=pytest.mark.slow),
], ids=["float64-block-gqa", "float32-none-window-traced-later", "float64-block-qk-norm"])
def test_one_graph_for_every_block(dtype: torch.dtype, checkpoint: str, flags: dict,
                                   traced_at: int) -> None:
    """Five full blocks (history 0, 4, … 16 tokens) and a ragged one, two training steps: one
    graph, compiled once; loss and every gradient as the eager loop's. `traced_at`: the first
    step runs the blocks before it eagerly, so the graph is traced at a block that reads a
    history (its anchor then comes from a publish: the ordering edge must survive tracing)."""
    model = tiny_model(dtype, attention="cpu_fused", activation_checkpoint=checkpoint,
                       block_size=4, **flags)
    eager = copy.deepcopy(model)
    fresh_dynamo()
    apply_compile(model)
    assert model.compiled_step is not None
    calls, steps = [], []
    compiled = model.compiled_step

    def step(*args, **kwargs):
        start = args[3].start.item()
        if len(steps) == 1 and start < traced_at:
            return run_block(*args, **kwargs)
        calls.append(start)
        return compiled(*args, **kwargs)

    model.compiled_step = step
    tolerance = dict(rtol=1e-11, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-4,
                                                                                 atol=1e-6)
    assert_trains_like(model, eager, steps=2, length=22, tolerance=tolerance,
                       before_step=steps.append)
    assert_graphs(1)
    # The full blocks through the graph (again in backward, recomputed under checkpointing);
    # the ragged last one (2 tokens) eagerly.
    assert sorted(set(calls)) == [0, 4, 8, 12, 16]
    assert len(calls) == 5 * 2 * (2 if checkpoint == "block" else 1) - traced_at // 4


def test_one_graph_under_bf16_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """train.precision = bf16 with a compiled step: the projections compute in bf16 and the
    fused kernels, which take float32 and float64, read a float32 history
    (`KeyLayout.stored_dtype`); loss and gradients as the eager loop's under autocast."""
    from megabeta.model.history import BufferedHistory

    dtypes = []
    allocate = BufferedHistory.allocate
    monkeypatch.setattr(BufferedHistory, "allocate", lambda self, *args, **kwargs: (
        dtypes.append(self.dtype), allocate(self, *args, **kwargs))[1])
    model = tiny_model(torch.float32, attention="cpu_fused", block_size=4)
    eager = copy.deepcopy(model)
    fresh_dynamo()
    apply_compile(model)
    x, y = tokens(2, 14), tokens(2, 14, seed=10)
    for m in (model, eager):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # backward outside, as TorchEngine
            loss = m(x, y)
        loss.backward()
        m.loss = loss.detach()
    torch.testing.assert_close(model.loss, eager.loss, rtol=1e-2, atol=1e-2)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3, msg=name)
    assert_graphs(1)
    assert dtypes == [torch.float32]


def test_compile_needs_a_backend_that_reads_the_start_from_a_tensor() -> None:
    model = build_model(tiny_config(), ExecutionConfig(attention="cpu_flash"))
    with pytest.raises(ConfigError, match="execution.attention = 'cpu_flash'"):
        apply_compile(model)


def test_other_arms_compile_their_residual_branches() -> None:
    model = randomise(build_model(tiny_config(arch="standard"), ExecutionConfig()).float())
    x = tokens(length=20)
    eager = model(x[:, :-1], x[:, 1:]).item()
    names = list(model.state_dict())
    apply_compile(model)
    assert hasattr(model._residual_branches, "_torchdynamo_orig_callable")
    assert model(x[:, :-1], x[:, 1:]).item() == pytest.approx(eager, rel=1e-5)
    assert list(model.state_dict()) == names


@pytest.mark.parametrize("documents", [False, True], ids=["unmasked", "documents"])
@pytest.mark.parametrize("start", [0, 5])
def test_history_attention_operator_is_well_registered_for_cpu_fused(start: int,
                                                                     documents: bool) -> None:
    """Schema, fake implementation (shapes and strides) and autograd registration of
    `megabeta::history_attention` agree with its "cpu_fused" implementation
    (torch.library.opcheck), with and without history rows, with and without document bounds
    (spec §7: a view of the pass's starts, as the static step passes them)."""
    gen = torch.Generator().manual_seed(start)

    def rand(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(grad)

    layers, batch, heads, kv, n, length, d = 3, 2, 4, 2, 3, 12, 8
    q = rand(1, batch, n, heads, d, grad=True).transpose(2, 3)
    k, v = rand(1, batch, kv, n, d, grad=True), rand(1, batch, kv, n, d, grad=True)
    hist = [rand(layers, batch, kv, length, d) for _ in range(2)]
    grads = [torch.zeros(layers, batch, kv, length, d, dtype=torch.float64) for _ in range(2)]
    # Documents from 0, 2 and start + 1 (sample 0), from 0 and 4 (sample 1).
    starts = torch.tensor([[0, 0, 2, 2, 2, 2, 7, 7, 7, 7, 7, 7],
                           [0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4]])
    starts[0, start + 1:] = start + 1
    lower = starts[None, :, start:start + n] if documents else None
    # Sources 1 and 2 of layer 1; the shift has a third, unused group (a wave's width).
    args = (q, k, v, *hist, *grads, torch.arange(length)[start], rand(1, 3, heads, grad=True),
            rand(1, grad=True), lower, None, [1, 2], [1], 2, 0, d ** -0.5, None, None,
            "cpu_fused")
    torch.library.opcheck(torch.ops.megabeta.history_attention.default, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


def test_every_anchor_is_zero() -> None:
    """A compiled step guards the value of its anchor input (dynamo takes a 0-d CPU float tensor
    as a number, guarded not NaN): every anchor a publish returns is 0, never reused memory that
    may hold a NaN, which would recompile the step (history.py, `_Publish`)."""
    from megabeta.model.history import BufferedHistory, block_cells

    history = BufferedHistory([[0, 1], [1]], 0, 64, dtype=torch.float64)
    history.allocate(1, 1, 8, device=torch.device("cpu"))
    fin = [torch.randn(1, 1, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    anchors = []
    for start in range(0, 60, 4):
        # Freed NaN scalars: the allocator hands their memory to the next small tensor.
        for _ in range(8):
            torch.full((), float("nan"), dtype=torch.float64)
        history.publish(block_cells(start, 2), fin, fin)
        anchors.append(history.step_view(start + 4, 4).anchor.item())
    assert anchors == [0.0] * len(anchors)
