"""`megabeta bench wavefront`'s options become its Settings (every option a field)."""

from __future__ import annotations

import dataclasses

import torch

from megabeta.bench.wavefront import Settings, parse_args, profiled


def test_every_option_is_a_settings_field() -> None:
    settings = parse_args([])
    assert settings == Settings()
    names = {f.name for f in dataclasses.fields(Settings)}
    assert set(vars(settings)) <= names


def test_the_elementwise_kernels_option_and_its_old_name() -> None:
    assert parse_args(["--elementwise-kernels", "torch"]).elementwise_kernels == "torch"
    assert parse_args(["--cell-kernels", "triton"]).elementwise_kernels == "triton"
    assert parse_args(["--dispatches-only", "--attention", "triton"]).dispatches_only


def test_profiled_lists_a_steps_operators_by_self_time() -> None:
    """`--profile N`: one step's N operators with the most self time, the most first; a step
    of matmuls and nothing else shows them, with their call count."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step() -> float:
        for _ in range(3):
            torch.mm(a, b)
        a.add(1.0)
        return 0.0

    leaders = profiled(step, 2)
    assert len(leaders) == 2
    assert leaders[0][0] == "aten::mm" and leaders[0][2] == 3
    assert leaders[0][1] >= leaders[1][1] > 0
    assert parse_args(["--profile", "5"]).profile == 5
