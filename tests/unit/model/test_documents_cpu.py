"""Document masks (spec §7) on the CPU backends `cpu_flash` and `cpu_fused`: every path they
serve (the block loop's merged parts on ATen's and on the fused kernels, the wavefront's batched
wave, the causal shortcut, the static block step): low precision against the naive reference,
their hand-routed gradients against the explicit backend's autograd, one compiled graph. (The
float64 logits of every backend against the reference: test_documents.py.)"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from megabeta.kernels import finished_groups
from megabeta.parallel.wrap import apply_compile
from reference_beta12 import reference_logits
from support.compile_counts import assert_graphs, fresh_dynamo
from support.model_helpers import ATTENTION, tiny_model, tokens

from test_model_exactness import CASES, T

BACKENDS = [name for name in ("cpu_flash", "cpu_fused") if name in ATTENTION]
SCHEDULES = ["block", "wavefront"]

def _ids(lengths: list[int]) -> list[int]:
    return [doc for doc, length in enumerate(lengths) for _ in range(length)]


PATTERNS = {
    # Per sample (batch 2), document lengths summing to T = 19.
    "first_block": [[2, 17], [1, 5, 13]],  # a boundary inside the first block
    "one_token": [[7, 1, 11], [18, 1]],  # a one-token document, also as the last token
    "whole": [[19], [19]],  # one document fills the sample: the unmasked result
    "many_short": [[2, 1, 3, 1, 2, 2, 1, 3, 1, 3], [1] * 4 + [3] * 5],
    "per_sample": [[9, 10], [3, 3, 3, 3, 3, 4]],  # different boundaries per sample
}


def documents(*patterns: str) -> torch.Tensor:
    """The patterns' samples, one after another (one batch: one forward for all of them)."""
    return torch.tensor([_ids(lengths) for name in patterns for lengths in PATTERNS[name]])


@functools.lru_cache(maxsize=None)
def _expected(case: str) -> torch.Tensor:
    model = tiny_model(attention="explicit", **CASES[case])
    ids = documents(*PATTERNS)
    return reference_logits(model.state_dict(), model.config, tokens(len(ids), T),
                            documents=ids)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 5e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("attention", BACKENDS)
def test_masked_low_precision_logits(attention: str, dtype: torch.dtype, atol: float) -> None:
    """float32 and bfloat16 models run the same paths at their precision (bf16 on cpu_flash:
    ATen's kernels with float32 masks); masked rows, some reading nothing of a group, stay
    finite."""
    ids = documents(*PATTERNS)
    for schedule in SCHEDULES:
        model = tiny_model(attention=attention, schedule=schedule, **CASES["gqa"]).to(dtype)
        got = model(tokens(len(ids), T), documents=ids)
        torch.testing.assert_close(got.double(), _expected("gqa"), rtol=0, atol=atol,
                                   msg=lambda m: f"{schedule}: {m}")


def _gradients(attention: str, ids: torch.Tensor, case: str, **execution: str
               ) -> dict[str, torch.Tensor]:
    model = tiny_model(attention=attention, **execution, **CASES[case])
    batch = len(ids)
    model(tokens(batch, T), tokens(batch, T, seed=2), documents=ids).backward()
    # No grad (a θ whose layer reads no deeper group) counts as a zero grad.
    return {n: torch.zeros_like(p) if p.grad is None else p.grad
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpoint", ["none", "block"])
@pytest.mark.parametrize("case", ["c3_k2", "c1_k2", "c_over_T", "deep_token_window", "gqa",
                                  "stride2", "no_extras"])
def test_masked_gradients_agree_with_explicit(case: str, checkpoint: str) -> None:
    """The history's key/value gradients and the biases' gradient rows are routed by hand; with
    a mask they must still be autograd's of the literal masked softmax."""
    ids = documents("many_short", "first_block", "one_token")
    want = _gradients("explicit", ids, case, activation_checkpoint=checkpoint)
    for attention in BACKENDS:
        for schedule in SCHEDULES:
            # The wavefront recomputes per wave, the block schedule per block.
            recompute = "wave" if schedule == "wavefront" and checkpoint == "block" else checkpoint
            got = _gradients(attention, ids, case, activation_checkpoint=recompute,
                             schedule=schedule)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-10,
                                           msg=lambda m: f"{attention} {schedule} {name}: {m}")


@pytest.mark.skipif(not finished_groups.build(), reason="the fused C++ kernels do not build")
@pytest.mark.parametrize("flags", [
    dict(num_kv_heads=2),
    pytest.param(dict(deep_token_window=6), marks=pytest.mark.slow),  # a second compile
], ids=["gqa", "window"])
def test_static_step_with_documents_is_one_graph(flags: dict) -> None:
    """`execution.compile = true` on cpu_fused: the bounds are a tensor input of the static
    step's operator, so every full block, masked, runs the one graph, compiled once; logits and
    gradients are the eager loop's."""
    model = tiny_model(attention="cpu_fused", block_size=4, **flags)
    eager = copy.deepcopy(model)
    fresh_dynamo()
    apply_compile(model)
    compiled, calls = model.compiled_step, []

    def step(*args, **kwargs):
        calls.append(args[3].start.item())
        return compiled(*args, **kwargs)

    model.compiled_step = step
    x, y = tokens(length=22), tokens(length=22, seed=2)
    ids = torch.tensor([_ids([3, 1, 9, 9]), _ids([6, 16])])
    for _ in range(2):  # the second pass runs the compiled graph again
        model.zero_grad()
        eager.zero_grad()
        loss, want = model(x, y, documents=ids), eager(x, y, documents=ids)
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-11, atol=1e-13)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-11, atol=1e-13, msg=name)
    assert_graphs(1)
    # Every full block, each pass, through that graph (the ragged last one runs eagerly).
    assert calls == [0, 4, 8, 12, 16] * 2
    # The logits too: the reference's.
    reference = reference_logits(model.state_dict(), model.config, x, documents=ids)
    torch.testing.assert_close(model(x, documents=ids), reference, rtol=0, atol=1e-9)
