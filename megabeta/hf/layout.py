"""How a megabeta model is laid out in a Hugging Face folder: the `config.json` key of each
`ModelConfig` field and the tensor name of each parameter, both ways.

The names follow the Llama family's (`hidden_size`, `model.layers.N.self_attn.q_proj.weight`,
`mlp.gate_proj`, ...), which the Hugging Face tools expect; beta_1.2's own fields and
parameters keep megabeta's names. `configuration_beta12.Beta12Config` takes the same keys
(tests/unit/hf/test_hf_layout.py checks that the two agree): the configuration file cannot
import this module, it travels alone.
"""

from __future__ import annotations

import re
from typing import Any

from megabeta.model.config import ModelConfig

MODEL_TYPE = "beta12"
"""`config.json`'s `model_type`."""

CONFIG_KEYS: dict[str, str] = {
    "arch": "arch",
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "hidden_dim": "intermediate_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "num_layers": "num_hidden_layers",
    "dropout": "dropout",
    "max_seq_len": "max_position_embeddings",
    "depth_window": "depth_window",
    "depth_stride": "depth_stride",
    "block_size": "block_size",
    "lambda_max": "lambda_max",
    "depth_bias": "depth_bias",
    "layer_enc": "layer_enc",
    "self_slot": "self_slot",
    "qk_norm": "qk_norm",
    "deep_token_window": "deep_token_window",
    "tie_embedding": "tie_word_embeddings",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "loops": "loops",
    "init_std": "initializer_range",
    "init_embed_scale": "init_embed_scale",
    "init_branch_scale": "init_branch_scale",
}
"""`ModelConfig` field -> `config.json` key, for every field that defines the model (all but
`init_from`, which says where a run's weights came from)."""

# (megabeta parameter name, Hugging Face tensor name); `{}` is the layer index.
_PARAMETERS = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{}.attention_norm.weight", "model.layers.{}.input_layernorm.weight"),
    ("layers.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    ("layers.{}.attention.wq.weight", "model.layers.{}.self_attn.q_proj.weight"),
    ("layers.{}.attention.wk.weight", "model.layers.{}.self_attn.k_proj.weight"),
    ("layers.{}.attention.wv.weight", "model.layers.{}.self_attn.v_proj.weight"),
    ("layers.{}.attention.wo.weight", "model.layers.{}.self_attn.o_proj.weight"),
    ("layers.{}.attention.q_norm.weight", "model.layers.{}.self_attn.q_norm.weight"),
    ("layers.{}.attention.k_norm.weight", "model.layers.{}.self_attn.k_norm.weight"),
    ("layers.{}.attention.e_k", "model.layers.{}.self_attn.e_k"),
    ("layers.{}.attention.e_v", "model.layers.{}.self_attn.e_v"),
    ("layers.{}.attention.f_q", "model.layers.{}.self_attn.f_q"),
    ("layers.{}.attention.depth_bias", "model.layers.{}.self_attn.depth_bias"),
    ("layers.{}.attention.self_bias", "model.layers.{}.self_attn.self_bias"),
    ("layers.{}.feed_forward.w1.weight", "model.layers.{}.mlp.gate_proj.weight"),
    ("layers.{}.feed_forward.w3.weight", "model.layers.{}.mlp.up_proj.weight"),
    ("layers.{}.feed_forward.w2.weight", "model.layers.{}.mlp.down_proj.weight"),
]


def _patterns(source: int) -> list[tuple[re.Pattern, str]]:
    target = 1 - source
    return [(re.compile("^" + re.escape(pair[source]).replace(r"\{\}", r"(\d+)") + "$"),
             pair[target]) for pair in _PARAMETERS]


_TO_HF = _patterns(0)
_FROM_HF = _patterns(1)


def _rename(name: str, patterns: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, target in patterns:
        match = pattern.match(name)
        if match:
            return target.format(*match.groups())
    return None


def hf_name(name: str) -> str:
    """The Hugging Face tensor name of megabeta parameter `name`; KeyError if it has none."""
    renamed = _rename(name, _TO_HF)
    if renamed is None:
        raise KeyError(f"megabeta parameter {name!r} has no Hugging Face name")
    return renamed


def megabeta_name(name: str) -> str | None:
    """The megabeta parameter of Hugging Face tensor `name`, or None when it is not one."""
    return _rename(name, _FROM_HF)


def config_fields(config: ModelConfig) -> dict[str, Any]:
    """`config`'s fields under their `config.json` keys."""
    return {key: getattr(config, field) for field, key in CONFIG_KEYS.items()}


DEFAULTS: dict[str, Any] = {**config_fields(ModelConfig(vocab_size=32000)),
                            "num_key_value_heads": None}
"""`Beta12Config`'s default of each key: ModelConfig's, a vocabulary of 32000 (the Llama
family's). transformers' `save_pretrained` leaves out a key whose value is its default."""


def model_config(fields: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` a `config.json` describes (a key it leaves out has Beta12Config's
    default, its other keys are ignored); ConfigError (a ValueError) for a bad value."""
    return ModelConfig(**{field: fields.get(key, DEFAULTS[key])
                          for field, key in CONFIG_KEYS.items()})
