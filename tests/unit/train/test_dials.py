"""beta_1.2's probe dials: the finished K/V's diversity against a naive pairwise loop, the
entropy and top-key dials against their definitions, θ beside λ, and the collapse warning on a
model whose finished values are one vector by construction."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megabeta.model import ModelConfig, build_model
from megabeta.train.dials import (
    DIVERSITY_POSITIONS,
    collapse_warning,
    diversity,
    parameter_dials,
    probe_dials,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def naive_diversity(x: torch.Tensor) -> tuple[float, float]:
    """Sample 0's pairwise mean cosine and varying share, written out position by position."""
    rows = [x[0, :, s].flatten().double() for s in range(x.shape[2])]
    cosines = [float(torch.dot(a, b) / (a.norm() * b.norm()))
               for a, b in itertools.permutations(rows, 2)]
    mean = torch.stack(rows).mean(0)
    square = sum(float(r.pow(2).sum()) for r in rows) / len(rows)
    return sum(cosines) / len(cosines), 1 - float(mean.pow(2).sum()) / square


def test_diversity_matches_the_pairwise_definition() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 2, 9, 4) + 0.7  # a shared component: cosine well above 0
    cosine, varying = diversity(x)
    expected = naive_diversity(x)
    assert cosine == pytest.approx(expected[0], abs=1e-12)
    assert varying == pytest.approx(expected[1], abs=1e-12)
    assert 0.1 < cosine < 0.9
    same = torch.randn(1, 2, 1, 4).expand(1, 2, 9, 4)
    assert diversity(same) == pytest.approx((1.0, 0.0), abs=1e-12)
    # Long histories are compared at DIVERSITY_POSITIONS positions, not all of them.
    long = torch.randn(1, 2, 5 * DIVERSITY_POSITIONS, 4)
    assert abs(diversity(long)[0]) < 0.1


def small_beta12(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    config = ModelConfig(arch="beta12", vocab_size=50, d_model=32, hidden_dim=64, num_heads=2,
                         num_layers=3, block_size=4, max_seq_len=32, depth_window=1, **kwargs)
    model = build_model(config).double()
    with torch.no_grad():  # extras away from zero; e_K, e_V small beside W_K·x, W_V·x
        for layer in model.layers:
            a = layer.attention
            for p in (a.f_q, a.depth_bias, a.self_bias):
                p.normal_()
            for p in (a.e_k, a.e_v):
                p.normal_(std=0.01)
    return model


def test_probe_dials_entropy_top_key_and_theta() -> None:
    model = small_beta12()
    tokens = torch.randint(0, 50, (1, 32))
    dials = probe_dials(model, tokens).dials()
    for layer in range(3):
        parts = [dials[f"entropy/layer{layer}/{g}"] for g in ("finished", "in_block", "self")]
        assert sum(parts) == pytest.approx(dials[f"entropy/layer{layer}/total"], rel=1e-9)
        assert all(p >= 0 for p in parts)
        # At most ln(keys) per query; the last block's queries see 28 earlier keys (x 2 groups).
        assert 0 < dials[f"entropy/layer{layer}/total"] < math.log(2 * 28 + 4)
        assert 1 / 60 < dials[f"top_key/layer{layer}"] < 1
        assert -1 <= dials[f"diversity/layer{layer}/value_cosine"] < 0.95
        assert 0 < dials[f"diversity/layer{layer}/value_varying"] <= 1
        assert f"diversity/layer{layer}/key_cosine" in dials
    scalars, _ = parameter_dials(model)
    theta = model.layers[2].attention.depth_bias.detach()
    assert scalars["theta/layer2/head1"] == pytest.approx(float(theta[1]))
    assert scalars["lambda/layer2/head1"] == pytest.approx(2 * float(torch.sigmoid(theta[1])))
    # A huge self bias puts all the mass on one key: top key 1, no entropy.
    with torch.no_grad():
        model.layers[1].attention.self_bias.fill_(80.0)
    dials = probe_dials(model, tokens).dials()
    assert dials["top_key/layer1"] == pytest.approx(1.0, abs=1e-9)
    assert dials["entropy/layer1/total"] == pytest.approx(0.0, abs=1e-9)


def test_collapse_is_named_when_every_finished_value_is_one_vector() -> None:
    model = small_beta12()
    tokens = torch.randint(0, 50, (1, 32))
    fresh = probe_dials(model, tokens).dials()
    assert collapse_warning(fresh, 0.95) is None
    # W_V = 0 in layer 1: its finished values are e_V at every position (spec §2), one vector.
    with torch.no_grad():
        model.layers[1].attention.wv.weight.zero_()
    collapsed = probe_dials(model, tokens).dials()
    assert collapsed["diversity/layer1/value_cosine"] == pytest.approx(1.0, abs=1e-12)
    assert collapsed["diversity/layer1/value_varying"] == pytest.approx(0.0, abs=1e-12)
    warning = collapse_warning(collapsed, 0.95)
    assert warning is not None and "layer1 1.000" in warning and "layer0" not in warning
    assert "monitor.collapse_cosine = 0.95" in warning
    assert collapse_warning(collapsed, 1.5) is None  # above 1: never
