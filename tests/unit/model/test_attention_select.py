"""The attention backend is chosen once, from execution.attention, the device and dropout, and
held by the model (model/attention/select.py)."""

from __future__ import annotations

import pytest
import torch

import megabeta.model.attention.select as select
import megabeta.model.transformer as transformer
from megabeta.kernels import finished_groups
from megabeta.model import ConfigError, ExecutionConfig
from support.model_helpers import tiny_model, tokens


def test_auto_picks_by_device_and_dropout() -> None:
    fused = "cpu_fused" if finished_groups.build() else "cpu_flash"
    assert tiny_model().attention_backend.name == fused
    assert tiny_model(dropout=0.1).attention_backend.name == "explicit"
    assert tiny_model(arch="standard").attention_backend.name == fused
    # Another device: the kernels of the cpu backends are not there.
    assert tiny_model().to("meta").attention_backend.name == "explicit"


@pytest.mark.parametrize("name", ["explicit", "cpu_flash", "cpu_fused"])
def test_named_backend_is_held(name: str) -> None:
    model = tiny_model(attention=name)
    assert model.attention_backend.name == name
    assert model.double().attention_backend.name == name  # a cast re-selects the same


@pytest.mark.parametrize("name,replacement", [("sdpa", "explicit"), ("cuda_flash", "triton")])
def test_removed_backend_names_its_replacement(name: str, replacement: str) -> None:
    with pytest.raises(ConfigError, match=f"execution.attention = '{name}' was removed: use "
                                          f"{replacement}"):
        ExecutionConfig(attention=name)


def test_what_a_backend_declares_is_what_the_model_enforces() -> None:
    """The chooser and the static-step check read the backends' capabilities, not names."""
    caps = {name: tiny_model(attention=name).attention_backend.capabilities
            for name in ("explicit", "cpu_flash", "cpu_fused")}
    assert caps["explicit"].dropout and caps["explicit"].devices is None
    assert not caps["cpu_flash"].static_step and caps["cpu_fused"].static_step
    for name, cap in caps.items():
        model = tiny_model(attention=name)
        if cap.static_step:
            model.compile_steps()
        else:
            with pytest.raises(ConfigError, match=f"execution.attention = '{name}'"):
                model.compile_steps()


@pytest.mark.parametrize("name,kw,message", [
    ("cpu_fused", dict(dropout=0.2), "execution.attention = 'cpu_fused' has no attention dropout"),
    ("cpu_flash", dict(dropout=0.2), "execution.attention = 'cpu_flash' has no attention dropout"),
])
def test_impossible_choice_is_a_config_error(name: str, kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_model(attention=name, **kw)


def test_cpu_backend_refuses_another_device() -> None:
    with pytest.raises(ConfigError, match="'cpu_fused' runs on cpu only.*meta"):
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


def _on_cuda(name: str, monkeypatch: pytest.MonkeyPatch, *, triton: bool,
             dropout: float = 0.0) -> str:
    """The backend `select_attention` picks for a CUDA model (no tensors are made)."""
    monkeypatch.setattr(select, "triton_runs_on", lambda device: triton)
    return select.select_attention(name, device=torch.device("cuda"), dropout=dropout,
                                   head_dim=8).name


def test_auto_on_cuda_prefers_triton_then_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    assert _on_cuda("auto", monkeypatch, triton=True) == "triton"
    assert _on_cuda("auto", monkeypatch, triton=True, dropout=0.1) == "explicit"
    with pytest.warns(UserWarning, match="without Triton.*megabeta\\[gpu\\]"):
        assert _on_cuda("auto", monkeypatch, triton=False) == "explicit"
    with pytest.raises(ConfigError, match="'cpu_fused' runs on cpu only, this model is on cuda"):
        _on_cuda("cpu_fused", monkeypatch, triton=True)


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
