"""Model configuration: the `ModelConfig` dataclass, named presets and the fair-comparison protocol.

Field names follow the architecture article (seeds/000, §8) so that configs written for the
reference implementation read the same here. The function a config selects is defined in
`shared/spec/beta12.md`; sections are cited as "spec §N".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ARCHS = ("beta12", "standard", "looped")

RESUMABLE_FIELDS = ("dropout", "max_seq_len", "init_std", "init_embed_scale", "init_branch_scale",
                    "init_from")
"""Fields a resumed run may change: a training hyperparameter, a length limit, and the
initialisation (the loaded weights replace it). Every other field shapes the parameters or the
function, and resuming refuses a change of it."""

MOVED_FIELDS = {"use_sdpa": "execution.attention (auto, reference, cpu, triton)",
                "activation_checkpoint": "execution.activation_checkpoint"}
"""Keys that used to be model fields, and where they live now (config files and CLI)."""


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the fix."""


@dataclass
class ModelConfig:
    """Shape and flags of one model arm. Every field is validated once, at construction."""

    arch: str = "beta12"
    """Model arm: `beta12` (spec §3), `standard` (plain causal RoPE Transformer) or `looped`."""
    vocab_size: int = -1
    """Vocabulary size; -1 = take it from the dataset sidecar before building the model."""
    d_model: int = 256
    """Residual stream width d."""
    hidden_dim: int = 1024
    """SwiGLU hidden width."""
    num_heads: int = 4
    """Query heads H; head width d_h = d_model / num_heads."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None = num_heads."""
    num_layers: int = 4
    """Physical layers L."""
    dropout: float = 0.0
    """Dropout on attention probabilities and residual branches (training only; may change on resume)."""
    max_seq_len: int = 2048
    """Longest sequence (training or prompt + generation) the model accepts (a limit; may change on resume)."""
    depth_window: int = 2
    """k: layer l reads finished KVs of layers l … min(l+k, L-1) (spec §3)."""
    depth_stride: int = 1
    """s: source layers are l, l+s, l+2s, … within the depth window (spec §3)."""
    block_size: int = 32
    """c: tokens per block; c >= T makes beta12 a standard Transformer (spec §4.1)."""
    lambda_max: float = 2.0
    """Upper bound of the per-head depth-bias slope λ = lambda_max·sigmoid(θ)."""
    depth_bias: bool = True
    """Subtract λ_{l,h}·(m-l) from scores of the finished group of source layer m."""
    layer_enc: bool = True
    """Learnable e_K, e_V (finished KVs) and f (queries) layer encodings (spec §2)."""
    self_slot: bool = True
    """Learnable scalar b_σ added to the score of the token's own key (spec §3)."""
    qk_norm: bool = False
    """Per-head RMS normalisation of queries and keys with learnable weights."""
    deep_token_window: int = 0
    """w: finished groups of deeper layers (m > l) see only the last w tokens before the block; 0 = off."""
    tie_embedding: bool = True
    """Share the LM head with the token embedding."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    loops: int = 2
    """`looped` arm only: times the weight-tied layer stack is applied."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    init_embed_scale: float = 1.0
    """The token embedding's initial standard deviation is init_std times this (its effect on the finished-value collapse: docs/research.md)."""
    init_branch_scale: float = 1.0
    """The residual branches' output projections (W_O, SwiGLU's w2) start at init_std/√(2L) times this."""
    init_from: str = ""
    """Start from the weights of this model (a folder of `megabeta export --format hf`, e.g. from the Hub, an export .safetensors or a checkpoint directory) instead of init_std's; its fields are the defaults of the others."""

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def validate(self) -> None:
        """Raise `ConfigError` naming the first invalid field and what to do about it."""

        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"model.{name} = {getattr(self, name)!r}: {why}")

        need(self.arch in ARCHS, "arch", f"must be one of {', '.join(ARCHS)}")
        need(self.vocab_size == -1 or self.vocab_size > 0, "vocab_size",
             "must be positive, or -1 to take it from the dataset")
        for name in ("d_model", "hidden_dim", "num_heads", "num_layers", "max_seq_len"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name,
                 "must be a positive integer")
        need(self.d_model % self.num_heads == 0, "d_model",
             f"must be divisible by num_heads = {self.num_heads}")
        need(self.head_dim % 2 == 0, "num_heads",
             f"head width d_model/num_heads = {self.head_dim} must be even for RoPE")
        need(isinstance(self.num_kv_heads, int) and self.num_kv_heads >= 1
             and self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
             f"must be a positive divisor of num_heads = {self.num_heads}")
        need(isinstance(self.block_size, int) and self.block_size >= 1, "block_size",
             "must be an integer >= 1 (use max_seq_len for one block)")
        need(isinstance(self.depth_window, int) and self.depth_window >= 0, "depth_window",
             "must be an integer >= 0")
        need(isinstance(self.depth_stride, int) and self.depth_stride >= 1, "depth_stride",
             "must be an integer >= 1")
        need(isinstance(self.deep_token_window, int) and self.deep_token_window >= 0,
             "deep_token_window", "must be an integer >= 0 (0 = off)")
        need(self.lambda_max >= 0, "lambda_max", "must be >= 0")
        need(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        need(self.rope_theta > 0, "rope_theta", "must be positive")
        need(self.norm_eps > 0, "norm_eps", "must be positive")
        need(isinstance(self.loops, int) and self.loops >= 1, "loops", "must be an integer >= 1")
        need(self.init_std > 0, "init_std", "must be positive")
        need(self.init_embed_scale > 0, "init_embed_scale", "must be positive (1 = init_std)")
        need(self.init_branch_scale >= 0, "init_branch_scale",
             "must be >= 0 (1 = init_std/√(2L); 0 starts every branch at zero)")

    def source_layers(self, layer: int) -> list[int]:
        """M(l) = {l, l+s, l+2s, …} ∩ [l, top(l)] with top(l) = min(l+k, L-1) (spec §3)."""
        top = min(layer + self.depth_window, self.num_layers - 1)
        return list(range(layer, top + 1, self.depth_stride))

    def replace(self, **changes: Any) -> "ModelConfig":
        """A validated copy with `changes` applied."""
        return dataclasses.replace(self, **changes)

    def identity(self) -> dict[str, Any]:
        """The fields that define the parameters and the function (all but RESUMABLE_FIELDS)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in RESUMABLE_FIELDS}

    def identity_changes(self, saved: dict[str, Any]) -> list[str]:
        """Identity fields whose value differs from `saved` (a saved config's fields)."""
        return sorted(k for k, v in self.identity().items() if k in saved and saved[k] != v)

    @classmethod
    def from_saved(cls, fields: dict[str, Any]) -> "ModelConfig":
        """The config stored with a checkpoint or export; keys of MOVED_FIELDS, which older
        checkpoints carry, are execution settings and are dropped."""
        return cls(**{k: v for k, v in fields.items() if k not in MOVED_FIELDS})


# The ~10 M-parameter ablation shape (article §7). The article does not print its widths; this one
# gives 10.4 M parameters at a 8192-token vocabulary: d = 192, 3 heads of 64, SwiGLU 512, L = 20.
_ARM_10M = dict(d_model=192, hidden_dim=512, num_heads=3, num_layers=20, max_seq_len=2048,
                depth_window=2, lambda_max=2.0, depth_bias=True, layer_enc=True, self_slot=True,
                qk_norm=False, deep_token_window=0, tie_embedding=True)

_PRESETS: dict[str, dict[str, Any]] = {
    # spec §6, verbatim from the article's §8.
    "t19_flash": dict(vocab_size=-1, d_model=1600, hidden_dim=3200, num_heads=8, num_layers=4,
                      dropout=0.0, max_seq_len=16384, depth_window=2, block_size=32,
                      lambda_max=2.0, depth_bias=True, layer_enc=True, self_slot=True,
                      qk_norm=False, deep_token_window=0, tie_embedding=True),
    "beta_1.2_test": dict(_ARM_10M, block_size=32),
    "beta_1.2_c256": dict(_ARM_10M, block_size=256),
    "t16_std_tf_rope": dict(_ARM_10M, arch="standard"),
}

# Depth-efficiency arms (article §7.2): half the physical layers, SwiGLU widened to the control's
# parameter count. The stride arm's window (k = 6) is our choice; the article only names the stride.
_FAIR_ARMS: dict[str, dict[str, Any]] = {
    "beta_1.2_de10k6": dict(num_layers=10, depth_window=6),
    "beta_1.2_de10k2": dict(num_layers=10, depth_window=2),
    "beta_1.2_stride2": dict(num_layers=10, depth_window=6, depth_stride=2),
}
FAIR_CONTROL = "t16_std_tf_rope"
FAIR_TOLERANCE = 0.005


def preset_names() -> list[str]:
    return sorted([*_PRESETS, *_FAIR_ARMS])


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The named configuration, with `overrides` applied (validated)."""
    if name in _PRESETS:
        return ModelConfig(**{**_PRESETS[name], **overrides})
    if name in _FAIR_ARMS:
        control = ModelConfig(**_PRESETS[FAIR_CONTROL])
        arm = resolve_fair_config(control, **{**_FAIR_ARMS[name], "block_size": 32})
        return arm.replace(**overrides) if overrides else arm
    raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(preset_names())}")


def count_parameters(config: ModelConfig) -> int:
    """Analytic parameter count of `build_model(config)` (spec §1; tests check it against the model).

    With vocab_size = -1 the embedding and head are left out (they are equal across arms anyway).
    """
    d, hd, kv = config.d_model, config.head_dim, config.num_kv_heads
    per_layer = (2 * d * config.num_heads * hd + 2 * d * kv * hd  # wq, wo, wk, wv
                 + 3 * d * config.hidden_dim + 2 * d)               # SwiGLU, two RMSNorms
    if config.arch == "beta12":
        per_layer += (2 * kv * hd + config.num_heads * hd) * config.layer_enc   # e_k, e_v, f_q
        per_layer += config.num_heads * config.depth_bias + 1 * config.self_slot
    if config.qk_norm:
        per_layer += 2 * hd
    vocab = max(config.vocab_size, 0)
    embed = vocab * d * (1 if config.tie_embedding else 2)
    return config.num_layers * per_layer + d + embed


def resolve_fair_config(control: ModelConfig, **arm: Any) -> ModelConfig:
    """A beta12 arm at the control's total parameter count (article §3.5, §7.2).

    `arm` overrides the control (by default `num_layers` is halved); the SwiGLU width is then the
    integer that brings the arm's parameter count closest to the control's, which must land within
    `FAIR_TOLERANCE` (0.5 %).
    """
    arm = {"arch": "beta12", "num_layers": max(1, control.num_layers // 2), **arm}
    target = count_parameters(control)
    probe = control.replace(**arm)
    per_unit = 3 * probe.d_model * probe.num_layers        # parameters per unit of hidden_dim
    fixed = count_parameters(probe.replace(hidden_dim=1)) - per_unit
    hidden = max(1, round((target - fixed) / per_unit))
    fair = probe.replace(hidden_dim=hidden)
    error = abs(count_parameters(fair) - target) / target
    if error > FAIR_TOLERANCE:
        raise ConfigError(f"resolve_fair_config: closest hidden_dim={hidden} is {error:.2%} off the "
                          f"control's {target} parameters (tolerance {FAIR_TOLERANCE:.1%}); "
                          "change num_layers or d_model of the arm")
    return fair


__all__ = ["ModelConfig", "ConfigError", "get_preset", "preset_names", "count_parameters",
           "resolve_fair_config", "FAIR_CONTROL", "FAIR_TOLERANCE", "ARCHS", "RESUMABLE_FIELDS",
           "MOVED_FIELDS"]
