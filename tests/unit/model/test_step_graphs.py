"""The captured steps (`execution.cuda_graphs`, model/step_graphs.py), checked on a CPU with
`EagerCapture` in place of CUDA graphs: the fixed tensors, the copies in and out and the
hand-out of the weights' gradients give the eager loop's loss and gradients (the wavefront's
waves: tests/integration/test_model_triton.py, which has a backend that reads waves statically)."""

from __future__ import annotations

import copy

import pytest
import torch

from megabeta.kernels import finished_groups
from megabeta.model import ConfigError, ExecutionConfig, build_model
from megabeta.model.step_graphs import EagerCapture, StepGraphs, Unit
from megabeta.model.history import BufferedHistory, HistoryView

from support.model_helpers import assert_trains_like, tiny_config, tiny_model, tokens


@pytest.mark.skipif(not finished_groups.build(),
                    reason="the fused C++ kernels do not build on this machine")
def test_replayed_steps_train_like_the_eager_loop() -> None:
    model = tiny_model(torch.float64, attention="cpu_fused", activation_checkpoint="block",
                       block_size=4, num_kv_heads=2)
    eager = copy.deepcopy(model)
    capture = EagerCapture()
    model.step_graphs = StepGraphs(capture)
    assert_trains_like(model, eager, steps=2, length=22,
                       tolerance=dict(rtol=1e-10, atol=1e-13))
    # One forward and one backward graph, captured at the first step and replayed since (the
    # second step's new weights were copied in, not captured again).
    assert capture.captured == 2
    model.eval()
    eager.eval()
    with torch.no_grad():
        x = tokens(2, 22, seed=5)
        torch.testing.assert_close(model(x), eager(x), rtol=1e-12, atol=1e-14)
    assert capture.captured == 2


@pytest.mark.skipif(not finished_groups.build(),
                    reason="the fused C++ kernels do not build on this machine")
def test_replayed_steps_with_documents_train_like_the_eager_loop() -> None:
    """Document bounds (spec §7) are copied into a fixed tensor like the block's input: the
    same two graphs serve every block and step, masked as the eager loop; a pass without
    documents afterwards captures graphs that read none."""
    model = tiny_model(torch.float64, attention="cpu_fused", activation_checkpoint="block",
                       block_size=4)
    eager = copy.deepcopy(model)
    capture = EagerCapture()
    model.step_graphs = StepGraphs(capture)
    starts = torch.zeros(2, 22, dtype=torch.int64)
    starts[0, [3, 9, 10]] = 1
    starts[1, [13]] = 1
    assert_trains_like(model, eager, steps=2, length=22, tolerance=dict(rtol=1e-10, atol=1e-13),
                       documents=starts.cumsum(1))
    assert capture.captured == 2
    assert_trains_like(model, eager, steps=1, length=22, tolerance=dict(rtol=1e-10, atol=1e-13))
    assert capture.captured == 4


@pytest.mark.parametrize("schedule,unit", [("block", "block"), ("wavefront", "wave")])
def test_cuda_graphs_need_the_schedules_checkpointing(schedule: str, unit: str) -> None:
    ExecutionConfig(cuda_graphs=True, schedule=schedule, activation_checkpoint=unit)
    with pytest.raises(ConfigError, match=f"activation_checkpoint = {unit}"):
        ExecutionConfig(cuda_graphs=True, schedule=schedule)


def test_cuda_graphs_on_a_cpu_model_say_so() -> None:
    model = build_model(tiny_config(), ExecutionConfig(cuda_graphs=True,
                                                       activation_checkpoint="block"))
    x = tokens(length=10)
    with pytest.raises(ConfigError, match="execution.cuda_graphs = true needs a CUDA device"):
        model(x[:, :-1], x[:, 1:])



class _OneWeight:
    """The pass weights' interface (`tensors`, `with_tensors`) around one matrix."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def tensors(self) -> list[torch.Tensor]:
        return [self.w]

    def with_tensors(self, tensors: list[torch.Tensor]) -> "_OneWeight":
        return _OneWeight(next(iter(tensors)))


def test_replayed_steps_keep_the_forwards_autocast() -> None:
    """Training runs under bf16 autocast with float32 weights, and autograd runs the backward
    graph's recompute outside the forward's autocast context: the graphs re-enter the state
    the forward ran in (on a GPU the recompute met a bf16 activation with a float32 weight)."""
    seen: list[tuple[bool, torch.dtype]] = []

    def step(inputs, constants, views, weights):  # a one-matmul unit recording its autocast
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return inputs[0] @ weights.w

    graphs = StepGraphs(EagerCapture())
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(1, 3, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        history = graphs.history_buffers((1, 1, 1, 3, 4), torch.bfloat16, x.device)
        keys, values, *grads = history
        view = HistoryView(BufferedHistory([[]], 0, 3, dtype=torch.bfloat16), keys, values,
                           torch.zeros((), dtype=torch.int64), None, None, grads=tuple(grads))
        graphs.begin_pass(_OneWeight(w), units=1)
        hidden = graphs.run(Unit(kind="matmul", fn=step, inputs=[x], constants=[],
                                 views=[view]))
    assert hidden.dtype == torch.bfloat16
    hidden.float().sum().backward()  # outside autocast, as autograd runs it
    assert seen and all(state == (True, torch.bfloat16) for state in seen), seen
    # d/dx and d/dw of sum(x @ w), at bf16 resolution; w's handed out by the pass's last block.
    torch.testing.assert_close(x.grad, w.detach().sum(1).expand(1, 3, 4), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(w.grad, x.detach().sum((0, 1))[:, None].expand(4, 4),
                               rtol=1e-2, atol=1e-2)


def test_a_dtype_cast_keeps_the_runtime_state_a_device_change_renews() -> None:
    """`.to(dtype)` keeps what the model holds for its device (captured graphs, pooled history
    buffers: keyed by dtype); only another device chooses the kernels again."""
    model = tiny_model(torch.float64, attention="explicit", activation_checkpoint="block")
    graphs = model.step_graphs = StepGraphs(EagerCapture())
    pool, backend = model.history_pool, model.attention_backend
    model.float()
    assert model.step_graphs is graphs and model.history_pool is pool
    assert model.attention_backend is backend
    model.to("meta")
    assert model.step_graphs is None and model.history_pool is None
    assert model.kernels_device == torch.device("meta")


def test_copies_around_a_replayed_unit_are_one_launch_per_dtype() -> None:
    """A unit's copies in and out (inputs, RoPE tables, starts; outputs and gradients) run as
    one multi-tensor copy per pair of dtypes, not one launch per tensor."""
    from megabeta.bench.dispatch import DispatchCount
    from megabeta.model.step_graphs import cloned, copy_all

    src = [torch.randn(3, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64),
           torch.randn(2, 2, dtype=torch.float64).t(), torch.tensor(7)]
    dst = [torch.empty_like(t) for t in src]
    with DispatchCount() as count:
        copy_all(dst, src)
        copies = cloned(src)
    assert dict(count.by_op) == {"_foreach_copy_": 4}
    for out in (dst, copies):
        assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(out, src))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(copies, src))
