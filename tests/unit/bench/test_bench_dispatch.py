"""Kernel launches per (block, layer) cell of a training step (megabeta.bench.dispatch): the
counts are deterministic, so they are tested; what each launch costs is a benchmark's business."""

from __future__ import annotations

import pytest
import torch

from megabeta.bench.dispatch import count_step, counting_config, per_cell
from megabeta.bench.roofline import LAUNCHES_PER_CELL
from megabeta.kernels import ops
from megabeta.kernels.ops import DispatchCount
from megabeta.model import ExecutionConfig, build_model
from megabeta.model.plan import WavePlan, period

SMALL = dict(block_size=8, d_model=32, hidden_dim=48, num_heads=2, num_kv_heads=2)
GPU_PATH_CEILING = 40
"""Launches per cell on the path a GPU takes (Triton attention and elementwise kernels), forward,
recompute and backward together, at the trainer's precision (bf16 autocast, float32 parameters)
and in float32."""


def test_custom_ops_count_what_they_launch() -> None:
    """A custom op is charged its ATen operators and Triton launches, not one call."""
    @ops.custom_op("test_two_adds")
    def two_adds(x: torch.Tensor) -> torch.Tensor:
        return (x + 1) + 1

    two_adds.register_fake(lambda x: torch.empty_like(x))
    x = torch.zeros(3)
    with DispatchCount() as count:
        two_adds(x).view(3)
    assert count.by_op == {"add": 2}
    assert count.total == 2


def test_mutating_custom_op_with_a_default_is_refused() -> None:
    """torch before 2.13 loses a mutated argument that a boxed call dropped as a default (an
    IndexError in the backward on torch 2.11): such a signature is refused where it is made."""
    def bump(x: torch.Tensor, out: torch.Tensor | None = None) -> None:
        pass

    with pytest.raises(TypeError, match=r"megabeta::test_bump .*default.*out"):
        ops.custom_op("test_bump", mutates_args=("out",))(bump)


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_gpu_path_launches_few_kernels_per_cell(bf16: bool) -> None:
    """At most GPU_PATH_CEILING launches a cell; under autocast not one cast a cell (the pass
    casts its weights once, the norms write the matmuls' dtype, the norm's backward writes the
    branch's gradient in its dtype) and no more launches than in float32; the weight gradients
    are formed once a pass (no matmul or add a cell for them); and far fewer than the
    reference backend's."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'megabeta[gpu]')")
    fused = per_cell("triton", elementwise_kernels="triton", bf16=bf16, **SMALL)
    reference = per_cell("reference", bf16=bf16, **SMALL)
    assert fused["per_cell"] <= GPU_PATH_CEILING, fused
    assert fused["ops_per_cell"].get("_to_copy", 0) == 0, fused["ops_per_cell"]
    if bf16:
        assert fused["per_cell"] <= per_cell("triton", elementwise_kernels="triton",
                                             **SMALL)["per_cell"]
        # The roofline's launch term counts what the step launches.
        assert abs(fused["per_cell"] - LAUNCHES_PER_CELL) <= 1, fused["per_cell"]
    # Forward, recompute and backward: 3 matmuls of the 5 projections a cell, bar the entering
    # and leaving blocks' (none of them a weight gradient's, nor an add of one).
    matmuls = sum(fused["ops_per_cell"].get(op, 0) for op in ("bmm", "baddbmm", "mm", "addmm"))
    assert matmuls <= 3 * 5, fused["ops_per_cell"]
    assert fused["ops_per_cell"].get("add", 0) < 1, fused["ops_per_cell"]
    assert fused["per_cell"] * 2 < reference["per_cell"], (fused["per_cell"],
                                                           reference["per_cell"])
    # Forward (run and recomputed) and backward of the attention: split-K forward and merge
    # twice, one backward and its reduction.
    launches = fused["launches"]
    assert launches["_forward_kernel"] == launches["_merge_kernel"]
    assert launches["_forward_kernel"] == 2 * launches["_backward_kernel"]


def test_counts_are_deterministic() -> None:
    first, second = (per_cell("cpu", blocks=(2, 3), **SMALL) for _ in range(2))
    assert first == second


def test_step_count_grows_by_the_cell_count() -> None:
    """Per cell is the marginal cost: a step of one more block costs L cells more."""
    config = counting_config(**SMALL)
    model = build_model(config, ExecutionConfig(attention="cpu", activation_checkpoint="block"))
    steps = [count_step(model, torch.zeros(1, n * 8, dtype=torch.long)).total for n in (2, 3, 4)]
    assert steps[2] - steps[1] == steps[1] - steps[0]


MATMULS = {"mm", "addmm", "addmv", "mv", "bmm", "baddbmm"}


def test_the_wavefront_launches_its_matmuls_and_attention_per_wave_not_per_cell() -> None:
    """6 layers, k = 1, 8 blocks: 20 waves of up to 3 cells instead of 48 cells. The wave's
    projections are one batched matmul each; its attention (cpu) is one kernel per wave in
    forward and recompute, one in backward; the step's launches fall accordingly."""
    config = counting_config(num_layers=6, depth_window=1, **SMALL)
    tokens = torch.randint(0, config.vocab_size, (1, 8 * config.block_size),
                           generator=torch.Generator().manual_seed(0))
    counts = {}
    for schedule, checkpoint in (("block", "block"), ("wavefront", "wave")):
        torch.manual_seed(0)
        model = build_model(config, ExecutionConfig(schedule=schedule, attention="cpu",
                                                    activation_checkpoint=checkpoint))
        counts[schedule] = count_step(model, tokens)
    waves = WavePlan(8, 6, period("wavefront", 6, 1)).waves
    assert waves == 20
    matmuls = {s: sum(n for op, n in c.by_op.items() if op.rstrip("_") in MATMULS)
               for s, c in counts.items()}
    assert matmuls["wavefront"] / waves <= 1.25 * matmuls["block"] / (8 * 6)
    wave, block = counts["wavefront"].by_op, counts["block"].by_op
    assert wave["megabeta_cpu::history_attention_forward"] == 2 * waves
    assert wave["megabeta_cpu::history_attention_backward"] == waves
    assert block["megabeta_cpu::history_attention_backward"] == 8 * 6
    assert counts["wavefront"].total <= 0.6 * counts["block"].total


def test_the_gpu_path_wavefront_launches_at_most_035x_the_block_schedule() -> None:
    """On the path a GPU takes (Triton attention and elementwise kernels): a
    beta_1.2_test-shaped step (L = 20, k = 2, 16 blocks of 32) on the wavefront launches at
    most 0.35x the block schedule's kernels, and t19_flash's (about 4/3 cells a wave) no more
    than the block schedule's. Triton launches are counted, not run (the counts do not depend
    on the numbers)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'megabeta[gpu]')")
    from megabeta.bench.wavefront import Settings, dispatches

    settings = Settings(attention="triton", elementwise_kernels="triton")
    beta = dispatches("beta_1.2_test", settings, torch.device("cpu"))
    t19 = dispatches("t19_flash", settings, torch.device("cpu"))
    assert beta["wavefront"] <= 0.35 * beta["block"], beta
    assert t19["wavefront"] <= t19["block"], t19


@pytest.mark.parametrize("attention", ["cpu", "triton"])
def test_a_document_mask_launches_nothing_more_per_cell(attention: str) -> None:
    """Spec §7's bounds are read inside the attention kernels, from views of the pass's
    document ids: a masked step launches no more per cell than an unmasked one."""
    if attention == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    kernels = "triton" if attention == "triton" else "torch"
    plain, masked = (per_cell(attention, elementwise_kernels=kernels, blocks=(2, 3),
                              documents=documents, **SMALL) for documents in (False, True))
    assert masked["per_cell"] <= plain["per_cell"], (masked["ops"], plain["ops"])
    assert masked["launches"] == plain["launches"]
