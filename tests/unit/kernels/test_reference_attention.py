"""The shared float64 block attention reference (tests/support/reference_attention.py) equals
the model's explicit backend, a separate literal implementation of spec §3, fed the same groups
as pieces with shift = λ_h·(m - l)."""

from __future__ import annotations

import pytest
import torch

from megabeta.model.attention.backend import AttentionBias, KeySet
from megabeta.model.attention.explicit import ExplicitAttention
from support.device_checks import AttentionCase, attention_inputs
from support.reference_attention import block_attention, group_rows


@pytest.mark.parametrize("window", [0, 7])
def test_reference_is_the_models_explicit_attention(window: int) -> None:
    case = AttentionCase("gqa+window", 2, 4, 2, 8, 5, 4, 30, 20, (1, 2, 3), 1, window)
    inputs = attention_inputs(case)
    slope = torch.rand(case.heads, dtype=torch.float64) + 0.5
    offsets = torch.tensor([m - case.layer for m in case.sources], dtype=torch.float64)
    got, _ = block_attention(inputs["q"], inputs["k"], inputs["v"], inputs["hist_k"],
                             inputs["hist_v"], offsets[:, None] * slope, inputs["self_bias"],
                             **case.geometry())
    rows = [group_rows(m, case.layer, case.start, case.window) for m in case.sources]
    keys = KeySet(k=inputs["k"], v=inputs["v"], finished=[
        (m - case.layer, inputs["hist_k"][m, :, :, r], inputs["hist_v"][m, :, :, r])
        for m, r in zip(case.sources, rows)])
    want = ExplicitAttention(case.head_dim).attend(
        inputs["q"], keys, AttentionBias(slope, inputs["self_bias"]), layer=case.layer,
        dropout_p=0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # The window cuts the deeper groups only.
    assert rows[0] == slice(0, 20) and rows[1] == slice(13 if window else 0, 20)
