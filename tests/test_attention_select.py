"""The attention backend is chosen once, from execution.attention, the device and dropout, and
held by the model (model/attention/select.py)."""

from __future__ import annotations

import pytest
import torch

import megabeta.model.transformer as transformer
from megabeta.kernels import finished_groups
from megabeta.model import ConfigError, ExecutionConfig
from model_helpers import tiny_model, tokens


def test_auto_picks_by_device_and_dropout() -> None:
    fused = "cpu_fused" if finished_groups.build() else "cpu_flash"
    assert tiny_model().attention_backend.name == fused
    assert tiny_model(dropout=0.1).attention_backend.name == "sdpa"
    assert tiny_model(arch="standard").attention_backend.name == fused
    # Another device: the kernels of the cpu backends are not there.
    assert tiny_model().to("meta").attention_backend.name == "sdpa"


@pytest.mark.parametrize("name", ["explicit", "sdpa", "cpu_flash", "cpu_fused"])
def test_named_backend_is_held(name: str) -> None:
    model = tiny_model(attention=name)
    assert model.attention_backend.name == name
    assert model.double().attention_backend.name == name  # a cast re-selects the same


def test_sdpa_layout_has_a_column_per_bias() -> None:
    """The sdpa backend stores the depth and self columns with the keys; the others do not."""
    assert tiny_model(attention="sdpa").attention_backend.layout.width == 8 + 2
    assert tiny_model(attention="sdpa", self_slot=False).attention_backend.layout.width == 8 + 1
    assert tiny_model(attention="sdpa", arch="standard").attention_backend.layout.width == 8
    assert tiny_model(attention="cpu_flash").attention_backend.layout.width == 8


@pytest.mark.parametrize("name,kw,message", [
    ("cpu_fused", dict(dropout=0.2), "execution.attention = 'cpu_fused' has no attention dropout"),
    ("cpu_flash", dict(dropout=0.2), "execution.attention = 'cpu_flash' has no attention dropout"),
])
def test_impossible_choice_is_a_config_error(name: str, kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_model(attention=name, **kw)


def test_cpu_backend_refuses_another_device() -> None:
    with pytest.raises(ConfigError, match="'cpu_fused' runs on CPU only.*meta"):
        tiny_model(attention="cpu_fused").to("meta")


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="execution.attention = 'flash': must be one of auto"):
        ExecutionConfig(attention="flash")


def test_no_choice_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward, backward and decoding use the backend held by the model: no selection runs."""
    model = tiny_model(block_size=4)
    calls = []
    monkeypatch.setattr(transformer, "select_attention", lambda *a, **k: calls.append(a))
    x = tokens(length=13)
    model(x, x).backward()
    model.eval()
    _, cache = model.prefill(x[:, :6])
    model.step(x[:, 6], cache)
    assert calls == []
