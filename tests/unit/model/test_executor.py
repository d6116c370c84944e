"""The executor (model/executor.py): the one place execution settings are read, what each
combination asks of a backend, and what compile and CUDA graphs cost in graphs and replays
(counts, not timings: exactness is the equivalence matrix's, test_equivalence.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from megabeta.kernels import cpu_attention
from megabeta.kernels.ops import LaunchCount
from megabeta.model import ConfigError, ExecutionConfig, build_model
from megabeta.model.graphs import EagerCapture
from support.compile_counts import assert_graphs, fresh_dynamo
from support.model_helpers import (assert_trains_like, graphed, tiny_config, tiny_model,
                                   tokens)

needs_cpu_kernels = pytest.mark.skipif(not cpu_attention.build(),
                                       reason="the fused C++ kernels do not build here")


@pytest.mark.parametrize("attention,compile_,form", [
    ("reference", False, "call"), ("triton", False, "pass"), ("triton", True, "autograd"),
    pytest.param("cpu", False, "call", marks=needs_cpu_kernels),
    pytest.param("cpu", True, "autograd", marks=needs_cpu_kernels)])
def test_the_weight_gradients_form_follows_where_the_kernels_run(attention: str, compile_: bool,
                                                                 form: str) -> None:
    """By hand once per pass where the attention kernels run on a GPU (triton, even
    interpreted on a CPU: its counts are the GPU's), per call on a CPU, by autograd in a
    compiled unit (layers.StackedWeight)."""
    model = tiny_model(attention=attention, compile=compile_)
    assert model.executor.settings.weight_gradients == form


@pytest.mark.parametrize("schedule,unit", [("block", "block"), ("wavefront", "wave")])
def test_cuda_graphs_need_the_schedules_recomputation(schedule: str, unit: str) -> None:
    ExecutionConfig(cuda_graphs=True, schedule=schedule, activation_checkpoint=unit)
    with pytest.raises(ConfigError, match=f"activation_checkpoint = {unit}"):
        ExecutionConfig(cuda_graphs=True, schedule=schedule)


def test_settings_a_backend_cannot_run_are_refused_when_the_model_is_built() -> None:
    with pytest.raises(ConfigError, match="execution.compile = true .* 'reference' does not"):
        tiny_model(attention="reference", compile=True)
    with pytest.raises(ConfigError, match="execution.cuda_graphs = true needs a CUDA device"):
        build_model(tiny_config(), ExecutionConfig(cuda_graphs=True,
                                                   activation_checkpoint="block"))
    if cpu_attention.build():
        with pytest.raises(ConfigError, match="'cpu' does"):
            graphed(tiny_model(attention="cpu", activation_checkpoint="block"), EagerCapture())
    with pytest.raises(ConfigError, match="model.dropout = 0.1 draws new ones"):
        build_model(tiny_config(dropout=0.1),
                    ExecutionConfig(attention="reference", cuda_graphs=True,
                                    activation_checkpoint="block"))


@needs_cpu_kernels
@pytest.mark.parametrize("checkpoint", ["block", "none"])
def test_one_graph_serves_every_full_block(checkpoint: str) -> None:
    """The block schedule compiled: two training steps of six blocks (the last ragged, padded),
    every block through one graph per grad mode, compiled once, and the loss and gradients the
    eager pass's."""
    model = tiny_model(attention="cpu", activation_checkpoint=checkpoint, block_size=4,
                       num_kv_heads=2, compile=True)
    eager = tiny_model(attention="cpu", activation_checkpoint=checkpoint, block_size=4,
                       num_kv_heads=2)
    fresh_dynamo()
    assert_trains_like(model, eager, steps=2, length=22,
                       tolerance=dict(rtol=1e-11, atol=1e-13))
    # With recomputation a block runs without autograd (forward) and with it (backward): one
    # graph each; without, one graph forward and backward.
    assert_graphs(2 if checkpoint == "block" else 1)


@needs_cpu_kernels
def test_compiled_units_under_bf16_autocast_train_like_eager() -> None:
    """train.precision = bf16: the fused CPU kernels read a float32 history
    (`KeyLayout.stored_dtype`) from bf16 projections, compiled as eagerly."""
    model = tiny_model(torch.float32, attention="cpu", activation_checkpoint="block",
                       block_size=4, compile=True)
    eager = copy.deepcopy(tiny_model(torch.float32, attention="cpu",
                                     activation_checkpoint="block", block_size=4))
    fresh_dynamo()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_trains_like(model, eager, steps=1, length=13,
                           tolerance=dict(rtol=2e-2, atol=2e-3))


def test_the_control_arms_compile_their_residual_branches() -> None:
    from megabeta.model.layers import residual_branches

    model = tiny_model(arch="standard", compile=True)
    assert model.executor.branches is not residual_branches
    fresh_dynamo()
    model(tokens(length=10), tokens(length=10, seed=2)).backward()
    assert_graphs(2)  # forward and backward of the branches' one dynamic graph


@pytest.mark.parametrize("length", [7, 31])
def test_a_graphed_micro_step_is_two_replays_at_any_length(length: int) -> None:
    """`execution.cuda_graphs`: the whole pass is two graphs, forward and backward with the
    recomputation; a micro-step replays each once however many blocks it has (here 3 and 11),
    the copies in and out its only other work. Triton's launches are counted, not run."""
    capture = EagerCapture()
    model = graphed(tiny_model(torch.float32, attention="triton",
                               elementwise_kernels="triton", activation_checkpoint="block",
                               block_size=3), capture)
    x, y = tokens(length=length), tokens(length=length, seed=2)
    with LaunchCount(run=False):
        for step in range(3):
            model(x, y).backward()
            assert capture.captured == 2
            assert capture.replays == 2 * (step + 1)


def test_a_graphed_pass_keeps_the_forwards_autocast() -> None:
    """Autograd runs the backward, and so the recomputation inside the backward graph, outside
    the forward's autocast context: the driver re-enters the forward's (on a GPU the recompute
    met a bf16 activation with a float32 weight)."""
    seen = []
    model = graphed(tiny_model(torch.float32, attention="triton",
                               elementwise_kernels="triton", activation_checkpoint="block",
                               block_size=3), EagerCapture())
    body = model.body
    attend = body.attention.attend

    def recording(q, *args, **kwargs):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), q.dtype))
        return attend(q, *args, **kwargs)

    body.attention.attend = recording
    with LaunchCount(run=False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens(length=7), tokens(length=7, seed=2))
        loss.backward()
    recomputed = [state for state in seen if state[0]]
    assert recomputed and all(state == (True, True, torch.bfloat16) for state in recomputed)


def test_a_dtype_cast_keeps_the_executor_a_device_change_renews() -> None:
    """`.to(dtype)` keeps what the model holds for its device (its executor and any captured
    graphs, keyed by dtype); only another device chooses again."""
    model = tiny_model(torch.float64, attention="reference")
    executor, backend = model.executor, model.attention_backend
    model.float()
    assert model.executor is executor and model.attention_backend is backend
    model.to("meta")
    assert model.executor is not executor and model.kernels_device == torch.device("meta")
