"""Documents in packed samples (spec §7): `model(tokens, targets, documents=ids)` on every
attention backend, schedule and arm.

Two independent checks: the model equals the naive reference extended by §7 (random and edge-case
boundaries), and with block-aligned documents each document's logits and gradients equal those
of the document run alone (the invariant §7 promises).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.model_helpers import ATTENTION, VOCAB, tiny_model, tokens
from reference_beta12 import reference_logits

T = 19  # ragged last block for c = 3 and 8

BOUNDARIES = {
    # Per sample (batch 2), the first position of each document after the first.
    "inside_first_block": ([1], [2, 9]),
    "one_token_document": ([4, 5], [18]),
    "one_document": ([], []),
    "many_short": ([2, 3, 5, 8, 11, 12, 16], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
    "block_edges": ([3, 6, 15], [9]),
}

CASES = {
    "c3_k2": dict(block_size=3),
    "c1": dict(block_size=1),
    "c8_ragged": dict(block_size=8),
    "c_over_T": dict(block_size=32),
    "c3_k0": dict(block_size=3, depth_window=0),
    "c3_kL": dict(block_size=3, depth_window=3),
    "stride2": dict(block_size=3, depth_window=3, num_layers=4, depth_stride=2),
    "deep_token_window": dict(block_size=3, depth_window=2, deep_token_window=4),
    "gqa_qk_norm": dict(block_size=4, num_kv_heads=2, qk_norm=True),
    "no_extras": dict(block_size=3, depth_bias=False, layer_enc=False, self_slot=False),
}


def ids_of(starts: list[int], length: int = T) -> torch.Tensor:
    """Document ids `[T]` with a new document at each of `starts`."""
    new = torch.zeros(length, dtype=torch.int64)
    new[starts] = 1
    return new.cumsum(0)


def batch_ids(pattern: str, length: int = T) -> torch.Tensor:
    return torch.stack([ids_of(s, length) for s in BOUNDARIES[pattern]])


@pytest.mark.parametrize("schedule", ["block", "wavefront"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("attention", ATTENTION)
def test_masked_model_matches_the_reference(attention: str, case: str, schedule: str) -> None:
    model = tiny_model(attention=attention, schedule=schedule, **CASES[case])
    x = tokens(length=T)
    for pattern in BOUNDARIES:
        ids = batch_ids(pattern)
        # The same weights for every backend and schedule (tiny_model's seed): one reference.
        key = (case, pattern)
        if key not in _REFERENCE:
            _REFERENCE[key] = reference_logits(model.state_dict(), model.config, x, documents=ids)
        torch.testing.assert_close(model(x, documents=ids), _REFERENCE[key], rtol=0, atol=1e-9,
                                   msg=pattern)


_REFERENCE: dict[tuple[str, str], torch.Tensor] = {}


@pytest.mark.parametrize("arch", ["standard", "looped"])
@pytest.mark.parametrize("attention", ATTENTION)
def test_control_arms_are_block_causal(arch: str, attention: str) -> None:
    """The control arms with a mask: the standard one equals the reference (§7 over causal
    attention); both equal each document run alone, wherever it starts (no blocks)."""
    model = tiny_model(attention=attention, arch=arch, loops=2)
    x, ids = tokens(length=T), batch_ids("one_token_document")
    got = model(x, documents=ids)
    if arch == "standard":
        expected = reference_logits(model.state_dict(), model.config, x, documents=ids)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)
    for b in range(2):
        for doc in ids[b].unique():
            where = (ids[b] == doc).nonzero().flatten()
            alone = model(x[b:b + 1, where])
            torch.testing.assert_close(got[b:b + 1, where], alone, rtol=0, atol=1e-10)


def aligned_sample(lengths: list[int], block: int, *, seed: int) -> tuple[torch.Tensor, ...]:
    """One packed sample of documents of `lengths`, each starting at a multiple of `block`:
    tokens, ids (padding carries ids of its own) and the documents' token slices."""
    gen = torch.Generator().manual_seed(seed)
    tokens_, ids, slices, position, doc = [], [], [], 0, 0
    for n in lengths:
        slices.append(slice(position, position + n))
        tokens_.append(torch.randint(0, VOCAB, (n,), generator=gen))
        ids += [doc] * n
        pad = -n % block
        tokens_.append(torch.zeros(pad, dtype=torch.int64))
        ids += [doc + 1] * pad
        position += n + pad
        doc += 2
    return torch.cat(tokens_)[None], torch.tensor(ids)[None], slices


def document_loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of a document's tokens (each predicts the next one)."""
    return F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum")


FLAGS = {
    "all": {},
    "no_depth_bias": dict(depth_bias=False),
    "no_layer_enc": dict(layer_enc=False),
    "no_self_slot": dict(self_slot=False),
    "qk_norm_gqa": dict(qk_norm=True, num_kv_heads=2),
    "window": dict(deep_token_window=2),
}


@pytest.mark.parametrize("schedule", ["block", "wavefront"])
@pytest.mark.parametrize("flags", sorted(FLAGS))
@pytest.mark.parametrize("attention", ATTENTION)
def test_block_aligned_documents_equal_each_document_alone(attention: str, flags: str,
                                                           schedule: str) -> None:
    """Spec §7: documents starting at multiples of c give, per document, the logits and
    the loss gradients of that document run alone from position 0."""
    model = tiny_model(attention=attention, schedule=schedule, block_size=3, **FLAGS[flags])
    x, ids, slices = aligned_sample([5, 1, 7, 3], 3, seed=len(flags))
    packed = model(x, documents=ids)
    loss = sum(document_loss(packed[:, s], x[:, s]) for s in slices)
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone_loss = 0
    for s in slices:
        alone = model(x[:, s])
        torch.testing.assert_close(packed[:, s], alone, rtol=0, atol=1e-10)
        alone_loss = alone_loss + document_loss(alone, x[:, s])
    alone_loss.backward()
    torch.testing.assert_close(loss, alone_loss, rtol=0, atol=1e-10)
    alone_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("attention", ATTENTION)
def test_unaligned_documents_depend_on_where_they_start(attention: str) -> None:
    """Without alignment a document's first block is shared with the previous document's tail
    (spec §7): its logits differ from its own run alone; with c >= T the mask alone suffices."""
    x = tokens(batch=1, length=T)
    ids = ids_of([4])[None]
    for block, equal in ((3, False), (32, True)):
        model = tiny_model(attention=attention, block_size=block)
        packed, alone = model(x, documents=ids)[:, 4:], model(x[:, 4:])
        assert torch.allclose(packed, alone, rtol=0, atol=1e-10) == equal


@pytest.mark.parametrize("attention", ATTENTION)
def test_one_document_is_the_unmasked_model(attention: str) -> None:
    model = tiny_model(attention=attention, block_size=3)
    x = tokens(length=T)
    torch.testing.assert_close(model(x, documents=torch.full_like(x, 7)), model(x),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("documents, message", [
    (torch.tensor([[0] * 10 + [1] * 9, [0] * 5 + [2] * 4 + [1] * 10]), "non-decreasing"),
    (torch.zeros(2, 18, dtype=torch.int64), "shape"),
    (torch.zeros(2, T), "integer"),
])
def test_malformed_documents_are_refused(documents: torch.Tensor, message: str) -> None:
    model = tiny_model(attention="reference")
    with pytest.raises(ValueError, match=message):
        model(tokens(length=T), documents=documents)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 5e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("attention", ATTENTION)
def test_masked_low_precision_logits(attention: str, dtype: torch.dtype, atol: float) -> None:
    """float32 and bfloat16 models run the same kernels at their precision (bf16 on `cpu`:
    a float32 history and float32 products); masked rows, some reading nothing of a group,
    stay finite."""
    ids = torch.cat([batch_ids(pattern) for pattern in ("many_short", "inside_first_block")])
    x = tokens(len(ids), T)
    for schedule in ("block", "wavefront"):
        model = tiny_model(attention=attention, schedule=schedule, **CASES["gqa_qk_norm"])
        expected = reference_logits(model.state_dict(), model.config, x, documents=ids)
        got = model.to(dtype)(x, documents=ids)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=atol,
                                   msg=lambda m: f"{schedule}: {m}")
