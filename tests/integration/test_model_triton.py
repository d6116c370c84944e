"""The model on the path a GPU takes: `execution.attention = "triton"` and
`execution.elementwise_kernels = "triton"`, under Triton's CPU interpreter in float32, against the naive
spec reference and the explicit backend's float64 gradients (spec §4.3). Shapes are tiny: the
interpreter runs every program instance in numpy."""

from __future__ import annotations

import pytest
import torch

from support.model_helpers import tiny_model, tokens
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
ARMS = {"standard": dict(arch="standard", num_layers=2)}


def _pair(case: str, **execution: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The triton model in float32 and the explicit one in float64, with the same weights."""
    overrides = {**SMALL, **{**CASES, **WAVE_CASES, **ARMS}[case]}
    reference = tiny_model(attention="explicit", **overrides)
    model = tiny_model(attention="triton", elementwise_kernels="triton", **execution, **overrides)
    model.load_state_dict(reference.state_dict())
    return model.float(), reference


WAVE_CASES = {
    # Waves of several cells (p = k + 1 < L): the wave kernel's cells, layers and sources
    # (k = 0, three cells a wave: test_triton_wavefront_attends_each_wave_in_one_launch).
    "c3_k0": dict(block_size=3, depth_window=0),
    "c2_k1_gqa_window": dict(block_size=2, num_heads=4, num_kv_heads=2, depth_window=1,
                             deep_token_window=3),
    "stride2": dict(block_size=3, num_layers=4, depth_window=2, depth_stride=2),
}


@pytest.mark.parametrize("case,schedule,checkpoint", [
    *((case, "block", "block") for case in sorted(CASES)),
    *((case, "wavefront", "wave") for case in sorted(CASES)),
    *((case, "wavefront", "none") for case in sorted(WAVE_CASES) if case != "c3_k0"),
])
def test_triton_path_matches_reference_and_explicit_gradients(case: str, schedule: str,
                                                              checkpoint: str) -> None:
    model, reference = _pair(case, activation_checkpoint=checkpoint, schedule=schedule)
    assert (model.attention_backend.name, model.elementwise_kernels.name) == ("triton", "triton")
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


def test_triton_wavefront_attends_each_wave_in_one_launch() -> None:
    """3 layers, k = 0: 6 waves of up to 3 cells; with wave checkpointing the attention launches
    one forward kernel per wave and per recompute, and one backward kernel per wave, and the
    loss and gradients are the explicit float64 model's."""
    from megabeta.kernels.ops import LaunchCount
    from megabeta.model.wavefront import WavePlan

    model, reference = _pair("c3_k0", activation_checkpoint="wave", schedule="wavefront")
    x = tokens(batch=1, length=T)
    with LaunchCount() as count:
        loss = model(x, x)
        loss.backward()
    waves = WavePlan(-(-T // 3), 3, 1).waves
    assert count.by_kernel["_forward_kernel"] == 2 * waves
    assert count.by_kernel["_backward_kernel"] == waves
    want = reference(x, x)
    want.backward()
    torch.testing.assert_close(loss.double(), want, atol=2e-5, rtol=1e-4)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:  # θ without a depth window
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad.double(), q.grad, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("schedule,checkpoint", [("block", "block"), ("wavefront", "wave")])
def test_triton_attention_reads_autocast_dtype_history(schedule: str, checkpoint: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Under autocast the attention kernels read queries and history in the autocast dtype
    (RoPE keeps the projections' dtype), not float32, and add the keys' gradients into float32
    buffers; loss and gradients follow the float64 reference at that precision. float16 stands
    in for bf16, whose tl.dot is wrong in the interpreter."""
    from megabeta.kernels import triton_attention

    seen = []
    for name in ("block_attention", "wave_attention"):
        def spy(q, k, v, hist_k, hist_v, grad_k, grad_v, *args, _run=getattr(
                triton_attention, name), **kwargs):
            if hist_k.numel():
                seen.append((q.dtype, k.dtype, hist_k.dtype, hist_v.dtype, grad_k.dtype))
            return _run(q, k, v, hist_k, hist_v, grad_k, grad_v, *args, **kwargs)
        monkeypatch.setattr(triton_attention, name, spy)
    model, reference = _pair("c2_k1_gqa_window", activation_checkpoint=checkpoint,
                             schedule=schedule)
    x = tokens(batch=1, length=T)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x, x)
    loss.backward()
    half, full = torch.float16, torch.float32
    assert seen and set(seen) == {(half, half, half, half, full)}
    want = reference(x, x)
    want.backward()
    torch.testing.assert_close(loss.double(), want, atol=1e-2, rtol=1e-2)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad.double(), q.grad, atol=1e-2, rtol=5e-2, msg=name)


# Spec §7. Sample 0: a one-token document, a boundary inside the first block (for every c
# here), a document across blocks, another one-token document, one from a block start to the
# end; sample 1: one document filling the sample.
DOCUMENTS = torch.tensor([[0, 1, 1, 1, 1, 2, 3, 3, 3, 3], [7] * T])


@pytest.mark.parametrize("case,schedule,checkpoint,batch", [
    ("c3_k2", "block", "block", 1), ("c2_k1_gqa_window", "wavefront", "none", 1),
    ("cT", "block", "block", 2), ("standard", "block", "none", 2)])
def test_triton_document_masks_match_reference_and_explicit_gradients(
        case: str, schedule: str, checkpoint: str, batch: int) -> None:
    """Document masks through the kernels on both schedules (history, waves of several cells)
    and in one block of T tokens (c = T and the standard arm: block-causal): logits against the
    spec §7 reference, gradients against the explicit backend's in float64. (Batch 1 where the
    interpreter is slowest: sample 0 has the boundaries.)"""
    model, reference = _pair(case, activation_checkpoint=checkpoint, schedule=schedule)
    assert model.attention_backend.capabilities.documents
    x, documents = tokens(batch=batch, length=T), DOCUMENTS[:batch]
    expected = reference_logits(reference.state_dict(), reference.config, x, documents=documents)
    torch.testing.assert_close(model(x, documents=documents).double(), expected,
                               atol=2e-5, rtol=1e-4)
    # The mask is in effect: the same tokens as one document give other logits.
    assert not torch.allclose(reference_logits(reference.state_dict(), reference.config, x),
                              expected, atol=1e-3)
    model(x, x, documents=documents).backward()
    reference(x, x, documents=documents).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad.double(), q.grad, atol=2e-5, rtol=1e-4, msg=name)


def _kinds_of_wave(config, length: int) -> int:
    from megabeta.model.wavefront import WavePlan

    layers = config.num_layers
    return WavePlan(-(-length // config.block_size), layers,
                    min(config.depth_window, layers - 1) + 1).kinds()


def _assert_trains_like_eager(model: torch.nn.Module, eager: torch.nn.Module,
                              length: int) -> None:
    """Two training steps (batch 1 of `length` tokens): the same loss and parameter
    gradients."""
    for step in range(2):
        x = tokens(batch=1, length=length, seed=step)
        results = []
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
            loss = m(x, x)
            loss.backward()
            results.append((loss, [p.grad for p in m.parameters()]))
        (loss, grads), (want, want_grads) = results
        torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
        for (name, _), got, expected in zip(model.named_parameters(), grads, want_grads):
            if expected is None:
                assert got is None or not got.any(), name
                continue
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("case,checkpoint", [("c2_k1_gqa_window", "wave")])
def test_triton_wavefront_compiles_once_per_kind_of_wave(case: str, checkpoint: str) -> None:
    """`execution.compile` on the wavefront schedule: over two training steps, each kind of
    wave (`WavePlan.kinds`: its layers, whether a block leaves or enters) compiles one graph,
    and loss and gradients are the eager wavefront's."""
    import copy

    from megabeta.parallel.wrap import apply_compile
    from support.compile_counts import assert_graphs, fresh_dynamo

    model, _ = _pair(case, activation_checkpoint=checkpoint, schedule="wavefront")
    eager = copy.deepcopy(model)
    fresh_dynamo()
    apply_compile(model)
    assert model.compiled_step is not None
    # Three blocks of c = 2, the last ragged: every kind of wave longer passes have (5).
    _assert_trains_like_eager(model, eager, length=5)
    assert_graphs(_kinds_of_wave(model.config, length=5))


@pytest.mark.parametrize("case", ["c3_k0"])
def test_triton_wavefront_replays_each_kind_of_wave(case: str) -> None:
    """`execution.cuda_graphs` on the wavefront schedule, `EagerCapture` standing in for CUDA
    graphs (model/step_graphs.py): each kind of wave captures a forward and a backward graph
    at the first step and replays them since (the second step's weights copied in); loss and
    gradients are the eager wavefront's, every wave's inputs, starts and outputs going through
    the fixed tensors."""
    import copy

    from megabeta.model.step_graphs import EagerCapture, StepGraphs

    model, _ = _pair(case, activation_checkpoint="wave", schedule="wavefront")
    eager = copy.deepcopy(model)
    capture = EagerCapture()
    model.step_graphs = StepGraphs(capture)
    # Four blocks of c = 3, the last ragged: every kind of wave longer passes have (6), waves
    # of one to three cells (k = 0).
    _assert_trains_like_eager(model, eager, length=T)
    kinds = _kinds_of_wave(model.config, length=T)
    assert capture.captured == 2 * kinds
    # Without autograd the forward graphs serve as they are.
    model.eval()
    eager.eval()
    with torch.no_grad():
        x = tokens(batch=1, length=T, seed=7)
        torch.testing.assert_close(model(x), eager(x), atol=1e-6, rtol=1e-5)
    assert capture.captured == 2 * kinds
