"""The captured block step (`execution.cuda_graphs`, model/block_graphs.py), checked on a CPU
with `EagerCapture` in place of CUDA graphs: the fixed tensors, the copies in and out and the
hand-out of the weights' gradients give the eager loop's loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from megabeta.kernels import finished_groups
from megabeta.model import ConfigError, ExecutionConfig, build_model
from megabeta.model.block_graphs import BlockGraphs, EagerCapture

from model_helpers import assert_trains_like, tiny_config, tiny_model, tokens


@pytest.mark.skipif(not finished_groups.build(),
                    reason="the fused C++ kernels do not build on this machine")
def test_replayed_steps_train_like_the_eager_loop() -> None:
    model = tiny_model(torch.float64, attention="cpu_fused", activation_checkpoint="block",
                       block_size=4, num_kv_heads=2)
    eager = copy.deepcopy(model)
    capture = EagerCapture()
    model.block_graphs = BlockGraphs(model._graphed_step, capture)
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


def test_cuda_graphs_need_block_checkpointing() -> None:
    with pytest.raises(ConfigError, match="activation_checkpoint = block"):
        ExecutionConfig(cuda_graphs=True)


def test_cuda_graphs_on_a_cpu_model_say_so() -> None:
    model = build_model(tiny_config(), ExecutionConfig(cuda_graphs=True,
                                                       activation_checkpoint="block"))
    x = tokens(length=10)
    with pytest.raises(ConfigError, match="execution.cuda_graphs = true needs a CUDA device"):
        model(x[:, :-1], x[:, 1:])
