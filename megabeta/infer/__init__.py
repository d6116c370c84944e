"""Inference: sampling continuations with the KV cache."""

from megabeta.infer.generate import generate, sample_next

__all__ = ["generate", "sample_next"]
