"""ModelConfig: presets, parameter counts (spec §1, §4.4, §6), the fair protocol, clear errors."""

from __future__ import annotations

import pytest

from megabeta.model import (ConfigError, ModelConfig, build_model, count_parameters, get_preset,
                            preset_names, resolve_fair_config)
from support.model_helpers import tiny_config


def numel(config: ModelConfig) -> int:
    return sum(p.numel() for p in build_model(config).parameters())


@pytest.mark.parametrize("overrides", [
    {}, dict(arch="standard"), dict(arch="looped", loops=3), dict(qk_norm=True),
    dict(num_kv_heads=2), dict(tie_embedding=False), dict(layer_enc=False),
    dict(depth_bias=False, self_slot=False),
])
def test_analytic_count_equals_model(overrides: dict) -> None:
    config = tiny_config(**overrides)
    assert count_parameters(config) == numel(config)


def test_beta_adds_only_the_spec_extras() -> None:
    """Per layer: e_K, e_V, f (3 d-vectors), θ per head and b_σ; nothing else (spec §1, §4.4)."""
    beta = tiny_config()
    d, h, layers = beta.d_model, beta.num_heads, beta.num_layers
    standard = numel(beta.replace(arch="standard"))
    per_layer_standard = 4 * d * d + 3 * d * beta.hidden_dim + 2 * d
    assert standard == layers * per_layer_standard + d + beta.vocab_size * d
    assert numel(beta) - standard == layers * (3 * d + h + 1)


def test_t19_flash_is_the_article_config() -> None:
    config = get_preset("t19_flash")
    expected = dict(vocab_size=-1, d_model=1600, hidden_dim=3200, num_heads=8, num_layers=4,
                    dropout=0.0, max_seq_len=16384, depth_window=2, block_size=32,
                    lambda_max=2.0, depth_bias=True, layer_enc=True, self_slot=True,
                    qk_norm=False, deep_token_window=0, tie_embedding=True)
    assert {k: getattr(config, k) for k in expected} == expected
    layers = count_parameters(config)  # vocab -1: layers (+ final norm) only
    assert 0.100e9 < layers < 0.105e9
    assert 0.185e9 < count_parameters(config.replace(vocab_size=55_000)) < 0.195e9


def test_ablation_arms_are_about_ten_million_parameters() -> None:
    for name in ("beta_1.2_test", "beta_1.2_c256", "t16_std_tf_rope"):
        total = count_parameters(get_preset(name, vocab_size=8192))
        assert 9.5e6 < total < 11e6, name
    assert get_preset("beta_1.2_test").block_size == 32
    assert get_preset("beta_1.2_c256").block_size == 256
    assert get_preset("t16_std_tf_rope").arch == "standard"


@pytest.mark.parametrize("name,layers,window,stride", [
    ("beta_1.2_de10k6", 10, 6, 1), ("beta_1.2_de10k2", 10, 2, 1), ("beta_1.2_stride2", 10, 6, 2)])
def test_depth_efficiency_arms_match_the_control(name: str, layers: int, window: int,
                                                 stride: int) -> None:
    control = get_preset("t16_std_tf_rope", vocab_size=8192)
    arm = get_preset(name, vocab_size=8192)
    assert (arm.arch, arm.num_layers, arm.depth_window, arm.depth_stride) == (
        "beta12", layers, window, stride)
    assert arm.hidden_dim > control.hidden_dim
    assert abs(numel(arm) - numel(control)) / numel(control) < 0.005


def test_resolve_fair_config_halves_layers_and_refuses_what_it_cannot_match() -> None:
    control = tiny_config(arch="standard", num_layers=4)
    fair = resolve_fair_config(control)
    assert fair.num_layers == 2 and fair.arch == "beta12"
    assert abs(count_parameters(fair) - count_parameters(control)) <= 0.005 * count_parameters(control)
    with pytest.raises(ConfigError, match="resolve_fair_config"):
        resolve_fair_config(tiny_config(arch="standard", num_layers=1, hidden_dim=1), num_layers=1,
                            d_model=64)


def test_every_preset_builds() -> None:
    for name in preset_names():
        assert get_preset(name).vocab_size == -1


@pytest.mark.parametrize("overrides,message", [
    (dict(d_model=30), "model.d_model = 30: must be divisible by num_heads"),
    (dict(d_model=48, num_heads=16), "model.num_heads = 16: head width .* must be even"),
    (dict(block_size=0), "model.block_size = 0: must be an integer >= 1"),
    (dict(depth_window=-1), "model.depth_window = -1: must be an integer >= 0"),
    (dict(depth_stride=0), "model.depth_stride = 0: must be an integer >= 1"),
    (dict(deep_token_window=-2), "model.deep_token_window = -2: must be an integer >= 0"),
    (dict(num_kv_heads=3), "model.num_kv_heads = 3: must be a positive divisor of num_heads"),
    (dict(arch="mamba"), "model.arch = 'mamba': must be one of beta12, standard, looped"),
    (dict(dropout=1.0), r"model.dropout = 1.0: must be in \[0, 1\)"),
    (dict(vocab_size=0), "model.vocab_size = 0: must be positive, or -1"),
    (dict(lambda_max=-1.0), "model.lambda_max = -1.0: must be >= 0"),
    (dict(loops=0), "model.loops = 0: must be an integer >= 1"),
])
def test_invalid_config_names_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides)


def test_unknown_preset_and_unresolved_vocab() -> None:
    with pytest.raises(ConfigError, match="unknown model preset 'gpt5'.*t19_flash"):
        get_preset("gpt5")
    with pytest.raises(ConfigError, match="vocab_size = -1"):
        build_model(get_preset("beta_1.2_test"))
