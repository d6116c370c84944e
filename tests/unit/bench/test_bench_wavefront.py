"""`megabeta bench wavefront`'s options become its Settings (every option a field)."""

from __future__ import annotations

import dataclasses

from megabeta.bench.wavefront import Settings, parse_args


def test_every_option_is_a_settings_field() -> None:
    settings = parse_args([])
    assert settings == Settings()
    names = {f.name for f in dataclasses.fields(Settings)}
    assert set(vars(settings)) <= names


def test_the_elementwise_kernels_option_and_its_old_name() -> None:
    assert parse_args(["--elementwise-kernels", "torch"]).elementwise_kernels == "torch"
    assert parse_args(["--cell-kernels", "triton"]).elementwise_kernels == "triton"
    assert parse_args(["--dispatches-only", "--attention", "triton"]).dispatches_only
