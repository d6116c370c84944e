"""Tiny model configurations and randomised weights shared by the model tests."""

from __future__ import annotations

from typing import Any, Callable

import torch

from megabeta.model import ConfigError, DecoderLM, ExecutionConfig, ModelConfig, build_model
from megabeta.model.attention.select import BACKENDS

VOCAB = 37

def _runs_here(name: str) -> bool:
    try:
        BACKENDS[name](8, device=torch.device("cpu"), setting=name)
    except ConfigError:
        return False
    return True


ATTENTION = [name for name in BACKENDS if name != "triton" and _runs_here(name)]
"""Every registered attention backend that runs natively on this CPU
(`attention/select.BACKENDS`), the reference first: Triton's runs here only under its
interpreter, in float32 (tests/unit/model/test_equivalence.py gives it rows of its own)."""


def tiny_config(**overrides: Any) -> ModelConfig:
    """A 3-layer, 4-head, width-32 model; overrides win."""
    base = dict(vocab_size=VOCAB, d_model=32, hidden_dim=48, num_heads=4, num_layers=3,
                block_size=3, depth_window=2, max_seq_len=64)
    return ModelConfig(**{**base, **overrides})


def randomise(model: DecoderLM, seed: int = 0, matrices: bool = False) -> DecoderLM:
    """Give every parameter a non-trivial value: extras (e_k, e_v, f_q, θ, b_σ) non-zero, norm
    weights away from one, so no flag's effect can hide behind its zero initialisation; with
    `matrices` also the weight matrices, at unit-scale outputs (attention far from uniform, as
    a check of low-precision kernels wants)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float64) + 0.5)
            elif p.dim() <= 1:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
            elif matrices and p.dim() == 2:
                scale = p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale)
    return model


def tiny_model(dtype: torch.dtype = torch.float64, seed: int = 0, attention: str = "auto",
               activation_checkpoint: str = "none", elementwise_kernels: str = "auto",
               schedule: str = "block", compile: bool = False, **overrides: Any) -> DecoderLM:
    """`tiny_config(**overrides)` with randomised weights, run with the attention backend, cell
    kernels, schedule, activation checkpointing and compile given."""
    torch.manual_seed(seed)
    execution = ExecutionConfig(attention=attention, activation_checkpoint=activation_checkpoint,
                                elementwise_kernels=elementwise_kernels, schedule=schedule,
                                compile=compile)
    return randomise(build_model(tiny_config(**overrides), execution).to(dtype), seed)


def tokens(batch: int = 2, length: int = 19, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_trains_like(model: DecoderLM, reference: DecoderLM, *, steps: int, length: int,
                       tolerance: dict[str, float],
                       before_step: Callable[[int], None] = lambda step: None,
                       documents: torch.Tensor | None = None) -> None:
    """`steps` training steps (batch 2 of `length` tokens) of `model` and `reference`: the same
    losses and parameter gradients within `tolerance` (assert_close's rtol/atol); a missing
    gradient counts as zero. `before_step(n)` runs before step n; `documents`: the batches'
    document ids (spec §7), or None."""
    kwargs = {} if documents is None else {"documents": documents}
    for step in range(steps):
        before_step(step)
        x, y = tokens(2, length, seed=step), tokens(2, length, seed=10 + step)
        model.zero_grad()
        reference.zero_grad()
        loss, want = model(x, y, **kwargs), reference(x, y, **kwargs)
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss, want, **tolerance)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if q.grad is None:
                assert p.grad is None or not p.grad.any(), name
            else:
                got = torch.zeros_like(q.grad) if p.grad is None else p.grad
                torch.testing.assert_close(got, q.grad, **tolerance, msg=name)


def graphed(model: DecoderLM, capture: Any) -> DecoderLM:
    """`model` with `execution.cuda_graphs = true`, its pass recorded by `capture` (on a CPU
    `megabeta.model.graphs.EagerCapture`, the stand-in for CUDA graphs)."""
    from dataclasses import replace

    from megabeta.model.executor import Executor

    model.execution = replace(model.execution, cuda_graphs=True)
    model.executor = Executor(model.execution, backend=model.attention_backend,
                              device=model.kernels_device, layers=model.config.num_layers,
                              capture=capture)
    return model
