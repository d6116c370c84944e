"""Inference: sampling continuations with the KV cache, and evaluation of a model's loss."""

from megabeta.infer.evaluate import evaluate
from megabeta.infer.generate import generate, sample_next

__all__ = ["evaluate", "generate", "sample_next"]
