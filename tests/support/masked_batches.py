"""A fixed global batch of masked samples with very unequal scored counts, shared by the masked-loss
tests and their multi-rank worker (tests/support/masked_step_worker.py)."""

from __future__ import annotations

import numpy as np
import torch

from megabeta.data import MaskedSample, collate_tokens

SEQ = 12
VOCAB = 37  # model_helpers.VOCAB
SCORED = [2, 9, 0, 5]
"""Scored targets of the four samples: a per-micro-batch mean would weight them very unequally."""
ATTENTION = "reference"
"""Exact like every backend, and needs no C++ build (`auto` may JIT-compile the fused kernels,
which the loss does not care about)."""


def global_samples() -> list[MaskedSample]:
    """Four samples of SEQ + 1 tokens; sample k scores SCORED[k] targets at seeded positions,
    and its inputs hold documents starting at seeded positions (spec §7, data.document_mask),
    so the engines' `documents=` is part of what the step computes."""
    rng = np.random.default_rng(7)
    samples = []
    for count in SCORED:
        tokens = rng.integers(0, VOCAB, SEQ + 1).astype(np.int64)
        mask = np.zeros(SEQ + 1, dtype=np.uint8)
        mask[1 + rng.choice(SEQ, size=count, replace=False)] = 1
        starts = np.zeros(SEQ, dtype=np.int32)
        starts[1 + rng.choice(SEQ - 1, size=2, replace=False)] = 1
        samples.append(MaskedSample(tokens, mask, starts.cumsum(dtype=np.int32)))
    return samples


def micro_batches(indices: list[list[int]]):
    """Collated micro-batches of the given sample indices (as the loader would make them)."""
    samples = global_samples()
    return [collate_tokens([samples[i] for i in group]) for group in indices]


def model_config() -> dict:
    """Flat TrainConfig settings for a TorchEngine around the tiny float64 model."""
    return {"model.vocab_size": VOCAB, "data.seq_len": SEQ, "optim.grad_clip": 0.0,
            "parallel.fsdp_param_dtype": "fp32", "parallel.fsdp_reduce_dtype": "fp32"}


def flat_gradients(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient (the full tensor of an FSDP2 shard), concatenated, float64."""
    parts = []
    for p in model.parameters():
        grad = p.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        parts.append(torch.zeros(p.numel(), dtype=torch.float64) if grad is None
                     else grad.detach().double().flatten())
    return torch.cat(parts)
