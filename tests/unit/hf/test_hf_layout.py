"""The folder's names (megabeta/hf/layout.py): every parameter of every arm and flag has one
Hugging Face name and comes back to itself; config.json's keys cover every field that defines a
model, and the configuration file transformers runs takes exactly those keys."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from megabeta.hf import layout
from megabeta.model import ModelConfig, build_model
from support.model_helpers import tiny_config

ARMS = [dict(), dict(qk_norm=True, tie_embedding=False, num_kv_heads=2),
        dict(layer_enc=False, depth_bias=False, self_slot=False), dict(arch="standard"),
        dict(arch="looped", qk_norm=True)]


@pytest.mark.parametrize("overrides", ARMS)
def test_every_parameter_round_trips_through_its_hugging_face_name(overrides):
    names = list(build_model(tiny_config(**overrides)).state_dict())
    hf = [layout.hf_name(name) for name in names]
    assert len(set(hf)) == len(hf)
    assert [layout.megabeta_name(name) for name in hf] == names
    assert all(name.startswith(("model.", "lm_head.")) for name in hf)


def test_names_that_are_no_parameter():
    with pytest.raises(KeyError, match="no Hugging Face name"):
        layout.hf_name("layers.0.attention.rotary.inv_freq")
    assert layout.megabeta_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert layout.megabeta_name("lm_head.bias") is None


def test_config_keys_cover_every_field_that_defines_the_model():
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(layout.CONFIG_KEYS) == fields - {"init_from"}
    config = tiny_config(num_kv_heads=2, qk_norm=True, block_size=5, rope_theta=123.0,
                         init_from="somewhere")
    back = layout.model_config(layout.config_fields(config))
    assert back == dataclasses.replace(config, init_from="")
    # transformers' save_pretrained leaves out keys at their default: they read as the default.
    fields = layout.config_fields(config)
    del fields["block_size"], fields["vocab_size"]
    assert layout.model_config(fields) == dataclasses.replace(
        config, init_from="", block_size=32, vocab_size=32000)


def test_the_configuration_file_takes_the_same_keys():
    pytest.importorskip("transformers")
    from megabeta.hf.configuration_beta12 import Beta12Config

    parameters = {name: p.default for name, p in inspect.signature(
        Beta12Config.__init__).parameters.items() if name not in ("self", "kwargs", "use_cache")}
    assert parameters == layout.DEFAULTS
    assert set(parameters) == set(layout.CONFIG_KEYS.values())
    config = tiny_config(num_kv_heads=1, depth_stride=2)
    hf = Beta12Config(**layout.config_fields(config))
    assert {key: getattr(hf, key) for key in layout.CONFIG_KEYS.values()} == (
        layout.config_fields(config))
    with pytest.raises(ValueError, match="arch = 'mamba'"):
        Beta12Config(arch="mamba")
