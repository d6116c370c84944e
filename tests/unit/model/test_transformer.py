"""DecoderLM's initialisation (model/transformer.py): init_std, and the two choices the spec
leaves open, the embedding's scale (model.init_embed_scale) and the residual branches' output
projections' (model.init_branch_scale); both are initialisation only, not identity."""

from __future__ import annotations

import math

import pytest
import torch

from megabeta.model import ConfigError, ModelConfig, build_model


def std_of(model: torch.nn.Module, suffix: str) -> float:
    values = torch.cat([p.detach().flatten() for n, p in model.named_parameters()
                        if n.endswith(suffix)])
    return float(values.std())


@pytest.mark.parametrize("embed, branch", [(1.0, 1.0), (50.0, 1.0), (1.0, 0.25), (1.0, 0.0)])
def test_the_embedding_and_branch_scales_set_their_standard_deviations(embed, branch) -> None:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=2000, d_model=128, hidden_dim=256, num_heads=4,
                         num_layers=8, init_std=0.02, init_embed_scale=embed,
                         init_branch_scale=branch)
    model = build_model(config)
    assert std_of(model, "tok_embeddings.weight") == pytest.approx(0.02 * embed, rel=0.02)
    branch_std = 0.02 * branch / math.sqrt(2 * 8)
    for suffix in ("wo.weight", "w2.weight"):
        assert std_of(model, suffix) == pytest.approx(branch_std, rel=0.03, abs=1e-12)
    for suffix in ("wq.weight", "wk.weight", "w1.weight"):
        assert std_of(model, suffix) == pytest.approx(0.02, rel=0.03)
    for name, p in model.named_parameters():
        if name.endswith(("e_k", "e_v", "f_q", "depth_bias", "self_bias")):
            assert not p.any(), name  # spec §2-§3: the extras start at zero


def test_the_scales_are_checked_and_are_not_the_models_identity() -> None:
    with pytest.raises(ConfigError, match="model.init_embed_scale = 0"):
        ModelConfig(init_embed_scale=0)
    with pytest.raises(ConfigError, match="model.init_branch_scale = -1"):
        ModelConfig(init_branch_scale=-1)
    base = ModelConfig()
    assert base.replace(init_embed_scale=10.0, init_branch_scale=0.5).identity_changes(
        base.identity()) == []
