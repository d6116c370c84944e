"""The device checks (tests/gpu/, `pytest -m gpu tests/gpu`): their error measure, tolerances,
cases and the functions that measure one check on a device. Each function returns the errors of
one comparison, `{what: max |got - want| / max |want|}`; the GPU tests assert them within a
tolerance, and the CPU tests run the same functions on CPU backends (and the Triton kernels
under its interpreter) to show that a check passes a right implementation and fails a wrong one.

References are float64 on the CPU: the block attention of support/reference_attention.py, the
torch cell functions of megabeta.model.layers, the model on the explicit backend.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch import Tensor

from megabeta.bench.gpu import count_graph_captures
from megabeta.model import DecoderLM, ExecutionConfig, ModelConfig, build_model
from megabeta.parallel.wrap import apply_compile
from support.compile_counts import fresh_dynamo, graphs_compiled
from support.model_helpers import randomise
from support.reference_attention import block_attention_grads

KERNEL_TOL = {"fp32": 1e-4, "bf16": 2e-2}
"""Kernel checks: max |kernel - float64 reference| over max |reference|, per output tensor."""
MODEL_TOL = {"fp32": 1e-4, "bf16": 5e-2}
"""Model checks (logits, loss), relative to the reference's largest magnitude as above."""
GRAD_TOL = {"fp32": 1e-3, "bf16": 5e-2}
"""Model parameter gradients (a few layers of rounding more than one kernel)."""
GRAD_FLOOR = {"fp32": 1e-3, "bf16": 1e-2}
"""Smallest gradient scale, as a fraction of the largest parameter gradient (see `rel_err`):
bf16 rounds the largest gradients at about 1e-2 of their scale, so a small gradient is judged
against that."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the gpu checks run on a GPU (pytest -m gpu tests/gpu)")]
"""A device check's marks (a module's `pytestmark`): selected by `-m gpu`, skipped without
CUDA."""
FULL_SIZE = pytest.mark.full_size
"""A parametrization at t19_flash's sizes (seconds to minutes where the small one takes
milliseconds): `-m "gpu and not full_size"` leaves them out."""


# ---- the measure ---------------------------------------------------------------------------------

def rel_err(got: Tensor | None, want: Tensor, floor: float = 0.0) -> float:
    """max |got - want| / max(max |want|, floor) (float64, on the CPU); inf for a missing
    tensor or a shape mismatch, nan when `got` holds NaN. `floor`: the scale of a reference
    that is (near) zero, e.g. the gradient of a parameter the loss does not depend on."""
    if got is None:
        return math.inf
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return math.inf
    if not want.numel():
        return 0.0
    err = (got - want).abs().max().item()
    scale = max(want.abs().max().item(), floor)
    return err / scale if scale > 0 else (0.0 if err == 0 else math.inf)


def worst(errors: dict[str, float]) -> tuple[str, float]:
    """The largest error (NaN counts as the largest) and its name."""
    name = max(errors, key=lambda k: math.inf if errors[k] != errors[k] else errors[k])
    return name, errors[name]


def within(errors: dict[str, float], tol: float) -> bool:
    """Every error within `tol` (NaN is not); no errors at all is not a pass."""
    return bool(errors) and all(e <= tol for e in errors.values())


def assert_within(errors: dict[str, float], tol: float) -> None:
    """An AssertionError naming the worst error and every error beyond `tol`."""
    if not within(errors, tol):
        name, value = worst(errors)
        beyond = {k: f"{e:.3g}" for k, e in errors.items() if not e <= tol}
        raise AssertionError(f"worst {name} {value:.3g} > tol {tol:g}; beyond tol: {beyond}")


def round_to(t: Tensor, dtype: torch.dtype) -> Tensor:
    """float64 values that `dtype` represents exactly: one reference serves every dtype."""
    return t.to(dtype).double()


def value_and_grads(fn: Callable[..., Tensor | tuple[Tensor, ...]], inputs: dict[str, Tensor],
                    weights: list[Tensor]) -> dict[str, Tensor]:
    """`fn`'s outputs (`out0`, … or `out`) and the gradients (`d<name>`; zero where unused) of
    `Σ out·weight` w.r.t. the inputs (fresh leaves)."""
    leaves = {k: t.detach().clone().requires_grad_() for k, t in inputs.items()}
    out = fn(*leaves.values())
    outs = list(out) if isinstance(out, tuple) else [out]
    loss = sum((o * w.to(o.device, o.dtype)).sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves.values(), grads)]
    result = {f"out{i}" if len(outs) > 1 else "out": o for i, o in enumerate(outs)}
    result.update({f"d{k}": g for k, g in zip(leaves, grads)})
    return result


# ---- the block attention kernel -----------------------------------------------------------------

@dataclass(frozen=True)
class AttentionCase:
    """One block attention call: a block of `n` queries at `layer` starting at `start`, reading
    groups `sources` of a `[layers, batch, kv_heads, length, head_dim]` history."""

    name: str
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    n: int
    layers: int
    length: int
    start: int
    sources: tuple[int, ...]
    layer: int
    window: int
    documents: bool = False
    """With document bounds (spec §7, `document_bounds`)."""

    def geometry(self) -> dict[str, Any]:
        return dict(sources=self.sources, layer=self.layer, start=self.start, window=self.window)

    def document_bounds(self) -> Tensor | None:
        """`[B, n]` int64 or None: sample 0's first half continues a document that began in
        the middle of the history (tiles below it skipped, the boundary tile masked), then a
        one-token document, then one to the block's end; further samples one document from
        position 0 (nothing masked)."""
        if not self.documents:
            return None
        half = self.n // 2
        first = (self.start // 2) + 3 if self.start else 0
        row = torch.cat([torch.full((half,), first), torch.tensor([self.start + half]),
                         torch.full((self.n - half - 1,), self.start + half + 1)])
        return torch.stack([row, *[torch.zeros(self.n, dtype=torch.int64)] * (self.batch - 1)])


ATTENTION_CASES = [
    # Interpreter sizes (d_h 24, tiles cut raggedly), the structure of t19_flash's calls.
    AttentionCase("mha", 1, 2, 2, 24, 8, 3, 40, 24, (0, 1, 2), 0, 0),
    AttentionCase("gqa+window", 2, 2, 1, 24, 8, 4, 40, 24, (1, 2, 3), 1, 10),
    AttentionCase("one block", 1, 2, 1, 24, 8, 0, 0, 0, (), 0, 0),
    # Document masks (spec §7) on the same structures.
    AttentionCase("gqa+window docs", 2, 2, 1, 24, 8, 4, 40, 24, (1, 2, 3), 1, 10, True),
    AttentionCase("one block docs", 1, 2, 1, 24, 8, 0, 0, 0, (), 0, 0, True),
    # t19_flash: d_h 200, 8 heads, c = 32, 3 groups, T = 4096; GQA with a deep-token window.
    AttentionCase("t19 mha", 1, 8, 8, 200, 32, 4, 4096, 2080, (0, 1, 2), 0, 0),
    AttentionCase("t19 gqa+window", 2, 8, 2, 200, 32, 4, 4096, 2080, (1, 2, 3), 1, 1000),
    AttentionCase("t19 one block", 1, 8, 8, 200, 32, 0, 0, 0, (), 0, 0),
    AttentionCase("t19 mha docs", 2, 8, 8, 200, 32, 4, 4096, 2080, (0, 1, 2), 0, 0, True),
]


def attention_inputs(case: AttentionCase, seed: int = 0) -> dict[str, Tensor]:
    """float64 CPU inputs, all representable in bfloat16: `q, k, v, hist_k, hist_v, shift,
    self_bias`, the output weights `grad` and the gradient buffers' earlier content
    `prior_k, prior_v` (the kernel must ADD to it)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0, offset: float = 0.0) -> Tensor:
        t = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + offset
        return round_to(t, torch.bfloat16)

    b, h, hkv, d, n = case.batch, case.heads, case.kv_heads, case.head_dim, case.n
    hist = (case.layers, b, hkv, case.length, d)
    return dict(q=rand(b, h, n, d), k=rand(b, hkv, n, d), v=rand(b, hkv, n, d),
                hist_k=rand(*hist), hist_v=rand(*hist),
                shift=round_to(torch.rand(len(case.sources), h, generator=gen,
                                          dtype=torch.float64) * 2, torch.bfloat16),
                self_bias=rand(1, scale=0.3, offset=1.5), grad=rand(b, h, n, d),
                prior_k=rand(*hist, scale=0.1), prior_v=rand(*hist, scale=0.1))


def reference_attention(case: AttentionCase, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """The float64 reference's output and gradients, named as `run_block_attention`'s (no
    history gradients without history)."""
    want = block_attention_grads(inputs, inputs["grad"], **case.geometry(),
                                 lower=case.document_bounds())
    del want["lse"]
    if not case.sources:
        del want["d_hist_k"], want["d_hist_v"]
    return want


def run_block_attention(case: AttentionCase, inputs: dict[str, Tensor], dtype: torch.dtype,
                        device: torch.device) -> dict[str, Tensor]:
    """`triton_attention.block_attention` forward and backward as the triton backend calls it:
    rows >= start of the history are NaN (never to be read), the start a 0-d view of a position
    table, the gradient buffers float32 holding `prior_*` (to be added to)."""
    from megabeta.kernels import triton_attention

    def leaf(name: str, kind: torch.dtype = dtype) -> Tensor:
        return inputs[name].to(device, kind).requires_grad_()

    q, k, v = leaf("q"), leaf("k"), leaf("v")
    shift, self_bias = leaf("shift", torch.float32), leaf("self_bias", torch.float32)
    if case.sources:
        hist_k, hist_v = (inputs[n].to(device, dtype) for n in ("hist_k", "hist_v"))
        hist_k[:, :, :, case.start:] = float("nan")
        hist_v[:, :, :, case.start:] = float("nan")
        grad_k, grad_v = (inputs[n].to(device, torch.float32) for n in ("prior_k", "prior_v"))
        start = torch.arange(case.length, device=device)[case.start]
    else:
        hist_k = hist_v = grad_k = grad_v = q.new_empty(0)
        start = torch.zeros((), dtype=torch.int64, device=device)
    lower = case.document_bounds()
    out = triton_attention.block_attention(
        q, k, v, hist_k, hist_v, grad_k, grad_v, start, shift, self_bias,
        sources=list(case.sources), layer=case.layer, window=case.window,
        scale=1.0 / math.sqrt(case.head_dim), lower=None if lower is None else lower.to(device))
    out.backward(inputs["grad"].to(device, dtype))
    result = dict(out=out, d_q=q.grad, d_k=k.grad, d_v=v.grad, d_shift=shift.grad,
                  d_self_bias=self_bias.grad)
    if case.sources:
        result["d_hist_k"] = grad_k.double().cpu() - inputs["prior_k"].float().double()
        result["d_hist_v"] = grad_v.double().cpu() - inputs["prior_v"].float().double()
    return result


def block_attention_errors(case: AttentionCase, dtype: torch.dtype,
                           device: torch.device) -> dict[str, float]:
    """The block attention kernel's output and every gradient against the float64 reference."""
    inputs = attention_inputs(case)
    want = reference_attention(case, inputs)
    got = run_block_attention(case, inputs, dtype, device)
    return {k: rel_err(got[k], want[k]) for k in want}


# ---- the elementwise kernels -----------------------------------------------------------------

ELEMENTWISE_KERNELS = ("rms_normalize", "add_rms_normalize", "split_heads_rope", "swiglu")
CELL_SHAPES = {
    "small": dict(rows=(2, 9, 40), heads=(2, 9, 3, 2, 8), gate_up=(2, 9, 2 * 24)),
    # t19_flash's widths: d 1600, d_h 200, hidden 3200; one c = 32 block's finished + input
    # projection: 24 rotary heads, 16 plain.
    "t19": dict(rows=(4, 32, 1600), heads=(4, 32, 24, 16, 200), gate_up=(4, 32, 2 * 3200)),
}
"""Rows `[B, n, d]`, the projection `[B, n, heads·d_h]` as (B, n, rotary heads, plain heads,
d_h) and SwiGLU's `[B, n, 2h]`."""
EPS = 1e-6


def cell_kernel_errors(kernel: str, size: str, dtype: torch.dtype,
                       device: torch.device) -> dict[str, float]:
    """The Triton implementation of the elementwise function `kernel`
    (megabeta.kernels.elementwise) against the torch one run in float64, forward and backward,
    at CELL_SHAPES[size]."""
    from megabeta.kernels import elementwise
    from megabeta.model import layers

    shapes = CELL_SHAPES[size]
    gen = torch.Generator().manual_seed(1)
    batch, n, rotary, plain, head_dim = shapes["heads"]
    # RoPE tables rounded to bf16, so the float64 reference sees the numbers the kernel reads;
    # the kernel gets them in the inputs' dtype, as DecoderLM.rope gives them.
    cos, sin = (round_to(t, torch.bfloat16) for t in layers.rope_tables(head_dim, 100, n, 1e4))
    rope = dict(rotary_heads=rotary, head_dim=head_dim)
    triton = dict(implementation="triton")
    kernels: dict[str, tuple[list[tuple[int, ...]], Callable[..., Any], Callable[..., Any]]] = {
        "rms_normalize": ([shapes["rows"]], lambda x: elementwise.rms_normalize(x, EPS, **triton),
                          lambda x: elementwise.rms_normalize(x, EPS)),
        "add_rms_normalize": ([shapes["rows"]] * 2,
                              lambda x, d: elementwise.add_rms_normalize(x, d, EPS, **triton),
                              lambda x, d: elementwise.add_rms_normalize(x, d, EPS)),
        "split_heads_rope": ([(batch, n, (rotary + plain) * head_dim)],
                             lambda y: elementwise.split_heads_rope(y, cos.to(y), sin.to(y),
                                                                    **rope, **triton),
                             lambda y: elementwise.split_heads_rope(y, cos, sin, **rope)),
        "swiglu": ([shapes["gate_up"]], lambda x: elementwise.swiglu(x, **triton),
                   elementwise.swiglu),
    }
    input_shapes, fn, reference = kernels[kernel]
    inputs = {f"x{i}": round_to(torch.randn(*shape, generator=gen, dtype=torch.float64),
                                torch.bfloat16)
              for i, shape in enumerate(input_shapes)}
    outputs = reference(*inputs.values())
    weights = [round_to(torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.bfloat16)
               for o in (outputs if isinstance(outputs, tuple) else (outputs,))]
    want = value_and_grads(reference, inputs, weights)
    got = value_and_grads(fn, {k: x.to(device, dtype) for k, x in inputs.items()}, weights)
    return {k: rel_err(got[k], want[k]) for k in want}


# ---- the model ----------------------------------------------------------------------------------

MODEL_SHAPES = {
    "small": (dict(vocab_size=61, d_model=32, hidden_dim=48, num_heads=4, num_layers=3,
                   block_size=8, depth_window=2, max_seq_len=64), 19, 11),
    "wide": (dict(vocab_size=97, d_model=160, hidden_dim=224, num_heads=4, num_layers=3,
                  block_size=8, depth_window=2, max_seq_len=128), 45, 13),
}
"""(config fields, sequence length, prompt length): a ragged last block, a prompt ending inside
a block; `wide`: heads of 40 and six blocks, the tiles of the kernels cut raggedly."""
MODEL_CASES = {"mha": {}, "gqa+window": dict(num_kv_heads=2, deep_token_window=12)}


def model_shape(shape: str, case: str) -> tuple[dict[str, Any], int, int]:
    """MODEL_SHAPES[shape] with MODEL_CASES[case]'s fields."""
    fields, length, prompt = MODEL_SHAPES[shape]
    return dict(fields, **MODEL_CASES[case]), length, prompt


def build_on(config: ModelConfig, device: torch.device, execution: ExecutionConfig) -> DecoderLM:
    """The model built ON `device` (float32), so that the backend is selected for it at once."""
    with torch.device(device):
        return build_model(config, execution)


def reference_model(config: ModelConfig, seed: int = 0) -> DecoderLM:
    """The float64 CPU model on the explicit backend, every parameter randomised."""
    torch.manual_seed(seed)
    model = build_model(config, ExecutionConfig(attention="explicit")).double()
    return randomise(model, seed, matrices=True)


def on_device(reference: DecoderLM, device: torch.device, dtype: torch.dtype,
              **execution: Any) -> DecoderLM:
    """`reference`'s weights on `device` in `dtype`, run with `execution`; the attention backend
    asked for must be the one the model runs (a check of another backend would pass
    silently)."""
    model = build_on(reference.config, device, ExecutionConfig(**execution))
    model.load_state_dict(reference.state_dict())
    wanted = execution.get("attention")
    if wanted not in (None, "auto") and model.attention_backend.name != wanted:
        raise AssertionError(f"attention = {wanted} runs {model.attention_backend.name} here")
    return model.to(dtype)


def tokens(vocab: int, batch: int, length: int, seed: int) -> Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def document_ids(batch: int, length: int, seed: int) -> Tensor:
    """Document ids `[batch, length]` (spec §7) of documents of 1 to length/3 tokens, seeded:
    boundaries inside blocks, on block edges and one-token documents alike."""
    gen = torch.Generator().manual_seed(seed)
    new = torch.rand(batch, length, generator=gen) < 3 / max(length, 3)
    new[:, 0] = False
    return new.cumsum(1)


def grads(model: DecoderLM) -> dict[str, Tensor]:
    """Every parameter's gradient, zero where it has none."""
    return {n: torch.zeros_like(p) if p.grad is None else p.grad
            for n, p in model.named_parameters()}


def grad_errors(got: dict[str, Tensor], want: dict[str, Tensor], dtype: torch.dtype,
                ) -> dict[str, float]:
    """Each parameter gradient's error; a parameter without influence (θ of a layer that reads
    no deeper group) has a zero reference gradient, so errors are measured against at least
    GRAD_FLOOR of the largest gradient's scale."""
    name = next(k for k, v in DTYPES.items() if v == dtype)
    floor = GRAD_FLOOR[name] * max(g.abs().max().item() for g in want.values())
    return {f"d {n}": rel_err(got[n], want[n], floor) for n in want}


def one_block_errors(backend: str, dtype: torch.dtype, device: torch.device,
                     fields: dict[str, Any], length: int) -> dict[str, float]:
    """beta_1.2 at c = T (b_σ = 0, f = 0) against the standard arm with the same weights: the
    float64 standard model's logits and the standard model on the device."""
    config = ModelConfig(**dict(fields, block_size=length))
    beta = reference_model(config)
    with torch.no_grad():
        for layer in beta.layers:
            layer.attention.self_bias.zero_()
            layer.attention.f_q.zero_()
    standard = build_model(config.replace(arch="standard"),
                           ExecutionConfig(attention="explicit")).double()
    standard.load_state_dict(beta.state_dict(), strict=False)
    x = tokens(config.vocab_size, 2, length, 1)
    want = standard(x)
    with torch.no_grad():
        got = on_device(beta, device, dtype, attention=backend)(x.to(device))
        twin = build_on(standard.config, device, ExecutionConfig(attention=backend))
        twin.load_state_dict(standard.state_dict())
        twin_logits = twin.to(dtype)(x.to(device))
    return {"logits vs float64 standard": rel_err(got, want),
            "vs standard on device": rel_err(got, twin_logits)}


def decoding_errors(backend: str, dtype: torch.dtype, device: torch.device,
                    fields: dict[str, Any], length: int, prompt: int) -> dict[str, float]:
    """Prefill of a prompt ending inside a block, then one step per token, against the
    forward."""
    config = ModelConfig(**fields)
    model = on_device(reference_model(config), device, dtype, attention=backend).eval()
    x = tokens(config.vocab_size, 2, length, 1).to(device)
    with torch.no_grad():
        full = model(x)
        logits, cache = model.prefill(x[:, :prompt])
        steps = [logits] + [model.step(x[:, t], cache)[:, None] for t in range(prompt, length)]
    return {"prefill+steps vs forward": rel_err(torch.cat(steps, dim=1), full)}


def explicit_errors(backend: str, dtype: torch.dtype, device: torch.device,
                    fields: dict[str, Any], length: int, documents: bool = False
                    ) -> tuple[dict[str, float], dict[str, float]]:
    """beta_1.2 on `backend` against the float64 CPU explicit backend, with block checkpointing
    as in training: (logits and loss errors, every parameter gradient's error); `documents`:
    with a document mask (`document_ids`)."""
    config = ModelConfig(**fields)
    reference = reference_model(config)
    x, y = tokens(config.vocab_size, 2, length, 1), tokens(config.vocab_size, 2, length, 2)
    ids = document_ids(2, length, 4) if documents else None
    with torch.no_grad():
        want_logits = reference(x, documents=ids)
    want_loss = reference(x, y, documents=ids)
    want_loss.backward()
    model = on_device(reference, device, dtype, attention=backend,
                      activation_checkpoint="block")
    ids = None if ids is None else ids.to(device)
    with torch.no_grad():
        got_logits = model(x.to(device), documents=ids)
    loss = model(x.to(device), y.to(device), documents=ids)
    loss.backward()
    return ({"logits": rel_err(got_logits, want_logits), "loss": rel_err(loss, want_loss)},
            grad_errors(grads(model), grads(reference), dtype))


def _paired_steps(models: list[DecoderLM], config: ModelConfig, length: int,
                  device: torch.device, dtype: torch.dtype, steps: int,
                  documents: bool = False) -> dict[str, float]:
    """`steps` training steps of the second model against the first (same tokens and, with
    `documents`, document ids): each step's loss error and its worst parameter gradient
    error."""
    errors: dict[str, float] = {}
    for step in range(steps):
        x = tokens(config.vocab_size, 2, length, 1 + step).to(device)
        y = tokens(config.vocab_size, 2, length, 3 + step).to(device)
        ids = document_ids(2, length, 5 + step).to(device) if documents else None
        results = []
        for m in models:
            m.zero_grad(set_to_none=True)
            loss = m(x, y, documents=ids)
            loss.backward()
            results.append((loss.detach(), grads(m)))
        (want_loss, want), (got_loss, got) = results
        errors[f"step {step} loss"] = rel_err(got_loss, want_loss)
        errors[f"step {step} gradients (worst)"] = max(grad_errors(got, want, dtype).values())
    return errors


def static_step_errors(backend: str, dtype: torch.dtype, device: torch.device,
                       fields: dict[str, Any], length: int, mode: str, documents: bool = False,
                       schedule: str = "block") -> tuple[dict[str, float], int]:
    """The static step, compiled (`mode` "compiled": execution.compile) or captured in CUDA
    graphs ("graphed": execution.cuda_graphs), against the eager loop of
    `schedule` on the same device and weights over two training steps with block (wavefront:
    wave) checkpointing: (the errors, how many graphs it took: compiled graphs, or CUDA graphs
    captured)."""
    config = ModelConfig(**fields)
    reference = reference_model(config)
    execution = dict(attention=backend, schedule=schedule,
                     activation_checkpoint="wave" if schedule == "wavefront" else "block")
    eager = on_device(reference, device, dtype, **execution)
    model = on_device(reference, device, dtype, cuda_graphs=mode == "graphed", **execution)
    fresh_dynamo()
    if mode == "compiled":
        apply_compile(model)
    captures = (count_graph_captures() if device.type == "cuda"
                else contextlib.nullcontext([0]))
    with captures as count:
        errors = _paired_steps([eager, model], config, length, device, dtype, steps=2,
                               documents=documents)
    graphs = (graphs_compiled() if mode == "compiled"
              else count[0])
    return errors, graphs


def wavefront_errors(backend: str, dtype: torch.dtype, device: torch.device,
                     fields: dict[str, Any], length: int, documents: bool = False
                     ) -> dict[str, float]:
    """The wavefront schedule with wave checkpointing against the block schedule on the same
    device and weights: loss and every parameter's gradient of one training step."""
    config = ModelConfig(**fields)
    reference = reference_model(config)
    models = [on_device(reference, device, dtype, attention=backend, **execution)
              for execution in (dict(activation_checkpoint="block"),
                                dict(schedule="wavefront", activation_checkpoint="wave"))]
    return _paired_steps(models, config, length, device, dtype, steps=1, documents=documents)
