"""Tiny model configurations and randomised weights shared by the model tests."""

from __future__ import annotations

from typing import Any

import torch

from megabeta.model import DecoderLM, ExecutionConfig, ModelConfig, build_model

VOCAB = 37

ATTENTION = ["explicit", "sdpa", "cpu_flash", "cpu_fused"]
"""Every attention backend that runs on this CPU (execution.attention)."""


def tiny_config(**overrides: Any) -> ModelConfig:
    """A 3-layer, 4-head, width-32 model; overrides win."""
    base = dict(vocab_size=VOCAB, d_model=32, hidden_dim=48, num_heads=4, num_layers=3,
                block_size=3, depth_window=2, max_seq_len=64)
    return ModelConfig(**{**base, **overrides})


def randomise(model: DecoderLM, seed: int = 0) -> DecoderLM:
    """Give every parameter a non-trivial value: extras (e_k, e_v, f_q, θ, b_σ) non-zero, norm
    weights away from one, so no flag's effect can hide behind its zero initialisation."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float64) + 0.5)
            elif p.dim() <= 1:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    return model


def tiny_model(dtype: torch.dtype = torch.float64, seed: int = 0, attention: str = "auto",
               activation_checkpoint: str = "none", cell_kernels: str = "auto",
               **overrides: Any) -> DecoderLM:
    """`tiny_config(**overrides)` with randomised weights, run with the attention backend, cell
    kernels and activation checkpointing given."""
    torch.manual_seed(seed)
    execution = ExecutionConfig(attention=attention, activation_checkpoint=activation_checkpoint,
                                cell_kernels=cell_kernels)
    return randomise(build_model(tiny_config(**overrides), execution).to(dtype), seed)


def tokens(batch: int = 2, length: int = 19, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
