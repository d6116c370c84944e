"""The attention backend is chosen once, from execution.attention, the device and dropout, and
held by the model (model/attention/select.py)."""

from __future__ import annotations

import pytest
import torch

import megabeta.model.attention.select as select
import megabeta.model.transformer as transformer
from megabeta.kernels import cpu_attention
from megabeta.model import ConfigError, ExecutionConfig
from support.model_helpers import tiny_model, tokens


def test_auto_picks_by_device_and_dropout() -> None:
    fused = "cpu" if cpu_attention.build() else "reference"
    assert tiny_model().attention_backend.name == fused
    assert tiny_model(dropout=0.1).attention_backend.name == "reference"
    assert tiny_model(arch="standard").attention_backend.name == fused
    # Another device: the CPU kernels are not there.
    assert tiny_model().to("meta").attention_backend.name == "reference"


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_named_backend_is_held(name: str) -> None:
    model = tiny_model(attention=name)
    assert model.attention_backend.name == name
    assert model.double().attention_backend.name == name  # a cast keeps it


@pytest.mark.parametrize("name,replacement", [
    ("explicit", "reference"), ("cpu_flash", "cpu"), ("cpu_fused", "cpu"),
    ("sdpa", "reference"), ("cuda_flash", "triton")])
def test_old_backend_names_name_their_replacement(name: str, replacement: str) -> None:
    with pytest.raises(ConfigError, match=f"execution.attention = '{name}' is gone: use "
                                          f"{replacement}"):
        ExecutionConfig(attention=name)


def test_what_a_backend_declares_is_what_the_model_enforces() -> None:
    """The chooser and the executor read the backends' capabilities, not names."""
    caps = {name: tiny_model(attention=name).attention_backend.capabilities
            for name in ("reference", "cpu")}
    assert caps["reference"].dropout and caps["reference"].devices is None
    assert not caps["reference"].traced and caps["cpu"].traced
    for name, cap in caps.items():
        if cap.traced:
            tiny_model(attention=name, compile=True)
        else:
            with pytest.raises(ConfigError, match=f"execution.attention = '{name}'"):
                tiny_model(attention=name, compile=True)


def test_impossible_choice_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="execution.attention = 'cpu' has no attention dropout"):
        tiny_model(attention="cpu", dropout=0.2)


def test_cpu_backend_refuses_another_device() -> None:
    with pytest.raises(ConfigError, match="'cpu' runs on cpu only.*meta"):
        tiny_model(attention="cpu").to("meta")


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


def _on_cuda(name: str, monkeypatch: pytest.MonkeyPatch, *, triton: bool,
             dropout: float = 0.0) -> str:
    """The backend `select_attention` picks for a CUDA model (no tensors are made)."""
    monkeypatch.setattr(select, "triton_runs_on", lambda device: triton)
    return select.select_attention(name, device=torch.device("cuda"), dropout=dropout,
                                   head_dim=8).name


def test_auto_on_cuda_prefers_triton_then_the_reference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    assert _on_cuda("auto", monkeypatch, triton=True) == "triton"
    assert _on_cuda("auto", monkeypatch, triton=True, dropout=0.1) == "reference"
    with pytest.warns(UserWarning, match="without Triton.*megabeta\\[gpu\\]"):
        assert _on_cuda("auto", monkeypatch, triton=False) == "reference"
    with pytest.raises(ConfigError, match="'cpu' runs on cpu only, this model is on cuda"):
        _on_cuda("cpu", monkeypatch, triton=True)


def test_triton_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    with pytest.raises(ConfigError, match="'triton' has no attention dropout"):
        tiny_model(attention="triton", dropout=0.1)  # under the interpreter (conftest)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="execution.attention = 'triton' runs on CUDA.*"
                                          "TRITON_INTERPRET=1"):
        tiny_model(attention="triton")
    with pytest.raises(ConfigError, match="execution.elementwise_kernels = 'triton' runs on CUDA"):
        tiny_model(elementwise_kernels="triton")


def test_elementwise_kernels_are_chosen_once_and_held() -> None:
    assert tiny_model().elementwise_kernels.name == "torch"  # auto on CPU
    pytest.importorskip("triton")
    model = tiny_model(elementwise_kernels="triton")
    assert model.elementwise_kernels.name == "triton"
    assert model.float().elementwise_kernels.name == "triton"
