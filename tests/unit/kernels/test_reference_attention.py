"""The shared float64 attention reference (tests/support/reference_attention.py) equals the
model's `reference` backend (model/attention/reference.py), a separate literal implementation of
spec §3, fed the same history and shift = λ_h·(m - l): neither can hide a bug the other has."""

from __future__ import annotations

import pytest
import torch

from megabeta.model.attention.backend import Biases, Reads
from megabeta.model.attention.reference import ReferenceAttention
from megabeta.model.history import History
from support.reference_attention import PERTURBATIONS, block_attention, group_rows


@pytest.mark.parametrize("window", [0, 7])
def test_reference_is_the_models_reference_backend(window: int) -> None:
    gen = torch.Generator().manual_seed(window)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    batch, heads, kv, width, n, layers, length, start, layer = 2, 4, 2, 8, 5, 4, 30, 20, 1
    sources = [[0, 1, 2], [1, 2, 3], [2, 3], [3]]
    q, k, v = rand(batch, heads, n, width), rand(batch, kv, n, width), rand(batch, kv, n, width)
    hist_k, hist_v = rand(layers, batch, kv, length, width), rand(layers, batch, kv, length, width)
    slope = torch.rand(heads, dtype=torch.float64, generator=gen) + 0.5
    self_bias = rand(1)
    offsets = torch.tensor([m - layer for m in sources[layer]], dtype=torch.float64)
    shift = offsets[:, None] * slope
    got, _ = block_attention(q, k, v, hist_k, hist_v, shift, self_bias, sources=sources[layer],
                             layer=layer, start=start, window=window)
    history = History(sources, window, hist_k, hist_v)
    want = ReferenceAttention(width).attend(
        q[None], k[None], v[None], Reads((layer,), history.view(start)),
        Biases(self_bias, shift[None]), dropout_p=0.0)
    torch.testing.assert_close(got, want[0].transpose(1, 2), rtol=0, atol=1e-12)
    # The window cuts the deeper groups only.
    rows = [group_rows(m, layer, start, window) for m in sources[layer]]
    assert rows[0] == slice(0, 20) and rows[1] == slice(13 if window else 0, 20)
    # Each perturbation of the shared reference changes its result: comparisons with it fail
    # where a kernel gets that term wrong.
    for perturb in PERTURBATIONS:
        if perturb == "window" and not window:
            continue
        wrong, _ = block_attention(q, k, v, hist_k, hist_v, shift, self_bias,
                                   sources=sources[layer], layer=layer, start=start,
                                   window=window, perturb=perturb)
        assert (wrong - got).abs().max() > 1e-6, perturb
