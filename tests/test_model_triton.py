"""The model on the path a GPU takes: `execution.attention = "triton"` and
`execution.cell_kernels = "triton"`, under Triton's CPU interpreter in float32, against the naive
spec reference and the explicit backend's float64 gradients (spec §4.3). Shapes are tiny: the
interpreter runs every program instance in numpy."""

from __future__ import annotations

import pytest
import torch

from model_helpers import tiny_model, tokens
from reference_beta12 import reference_logits

pytest.importorskip("triton", reason="triton is not installed (pip install 'megabeta[gpu]')")

T = 10  # the last block is ragged for every c below
SMALL = dict(d_model=16, hidden_dim=24, num_heads=2, max_seq_len=16)
CASES = {
    "c3_k2": dict(block_size=3),
    "gqa_window": dict(block_size=4, num_heads=4, num_kv_heads=2, deep_token_window=3),
    "no_extras": dict(block_size=3, depth_bias=False, layer_enc=False, self_slot=False),
    "cT": dict(block_size=16),
}


def _pair(case: str, **execution: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The triton model in float32 and the explicit one in float64, with the same weights."""
    overrides = {**SMALL, **CASES[case]}
    reference = tiny_model(attention="explicit", **overrides)
    model = tiny_model(attention="triton", cell_kernels="triton", **execution, **overrides)
    model.load_state_dict(reference.state_dict())
    return model.float(), reference


@pytest.mark.parametrize("schedule,checkpoint", [("block", "block"), ("wavefront", "wave")])
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_path_matches_reference_and_explicit_gradients(case: str, schedule: str,
                                                              checkpoint: str) -> None:
    model, reference = _pair(case, activation_checkpoint=checkpoint, schedule=schedule)
    assert (model.attention_backend.name, model.cell_kernels.name) == ("triton", "triton")
    x = tokens(batch=1, length=T)
    expected = reference_logits(reference.state_dict(), reference.config, x)
    torch.testing.assert_close(model(x).double(), expected, atol=2e-5, rtol=1e-4)
    model(x, x).backward()
    reference(x, x).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad.double(), q.grad, atol=2e-5, rtol=1e-4, msg=name)


def test_triton_decoding_matches_forward() -> None:
    """Prefill + steps (the history as pieces: the merged fallback) equal the forward logits."""
    model, _ = _pair("c3_k2")
    x = tokens(batch=1, length=T)
    with torch.no_grad():
        full = model(x)
        logits, cache = model.prefill(x[:, :5], capacity=T)
        steps = [model.step(x[:, i], cache) for i in range(5, T)]
    torch.testing.assert_close(torch.cat([logits, torch.stack(steps, 1)], 1), full,
                               atol=2e-5, rtol=1e-4)
