"""Generation (megabeta/infer/generate.py): greedy decoding is the argmax of the full forward,
sampling is seeded, and top-k / top-p keep the right tokens."""

from __future__ import annotations

import pytest
import torch

from megabeta.infer import generate, sample_next
from support.model_helpers import tiny_model, tokens


@pytest.mark.parametrize("arch", ["beta12", "standard", "looped"])
def test_greedy_generation_equals_argmax_of_full_forward(arch: str) -> None:
    model = tiny_model(arch=arch, block_size=3)
    prompt = tokens(length=5)
    out = generate(model, prompt, max_new_tokens=7, temperature=0)
    assert out.shape == (2, 12)
    assert torch.equal(out[:, :5], prompt)
    for t in range(5, 12):
        assert torch.equal(out[:, t], model(out[:, :t])[:, -1].argmax(-1))


def test_sampling_is_seeded_and_filters_apply() -> None:
    model = tiny_model(block_size=3)
    prompt = tokens(length=4)
    a = generate(model, prompt, 6, temperature=1.0, top_k=5, seed=7)
    b = generate(model, prompt, 6, temperature=1.0, top_k=5, seed=7)
    c = generate(model, prompt, 6, temperature=1.0, top_k=5, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(generate(model, prompt, 6, top_k=1, seed=3),
                       generate(model, prompt, 6, temperature=0))


def test_top_k_and_top_p_keep_the_right_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen_k = {int(sample_next(logits, 1.0, 2, None, gen)) for _ in range(200)}
    seen_p = {int(sample_next(logits, 1.0, None, 0.7, gen)) for _ in range(200)}
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}  # 0.5 < 0.7 needs the second token, 0.8 >= 0.7 stops there
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, 1.0, None, 1.5, gen)


