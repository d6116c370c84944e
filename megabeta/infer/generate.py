"""Autoregressive generation with a KV cache: one prefill, then one `step` per new token."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from megabeta.model.transformer import DecoderLM


def sample_next(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> Tensor:
    """Next token ids `[B]` from logits `[B, V]`. `temperature = 0` is greedy."""
    if temperature < 0:
        raise ValueError(f"temperature = {temperature}: must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k = {top_k}: must be >= 1, or None for no limit")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p = {top_p}: must be in (0, 1], or None for no limit")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # Nucleus: keep the smallest set of most likely tokens whose probability reaches top_p.
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: "DecoderLM", prompt: Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None,
             stop: Callable[[Tensor], bool] | None = None) -> Tensor:
    """Prompt `[B, T]` (or `[T]`) followed by `max_new_tokens` sampled tokens.

    The same `seed` gives the same tokens. The cache holds exactly prompt + new tokens.
    `stop(new)` is asked after each new token with the new tokens so far `[B, n]`; when it says
    True generation ends there (fewer than `max_new_tokens` new tokens come back): the caller's
    stop sequences, which need the text and so the tokenizer.
    """
    if prompt.dim() == 1:
        return generate(model, prompt[None], max_new_tokens, temperature, top_k, top_p, seed,
                        stop)[0]
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 0")
    if max_new_tokens == 0:
        return prompt
    generator = None
    if seed is not None:
        generator = torch.Generator(device=prompt.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        logits, cache = model.prefill(prompt, capacity=prompt.shape[1] + max_new_tokens)
        out = [prompt]
        token = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
        for _ in range(max_new_tokens - 1):
            out.append(token[:, None])
            if stop is not None and stop(torch.cat(out[1:], dim=1)):
                break
            token = sample_next(model.step(token, cache), temperature, top_k, top_p, generator)
        else:
            out.append(token[:, None])
    finally:
        model.train(was_training)
    return torch.cat(out, dim=1)


def stop_at_token(token_id: int) -> Callable[[Tensor], bool]:
    """A `stop` for :func:`generate`: True once every row has produced `token_id` (the
    end-of-document token: a model trained on packed documents goes on with an unrelated
    document after it)."""
    return lambda new: bool((new == token_id).any(dim=1).all())


def cut_at_token(new: Tensor, token_id: int) -> Tensor:
    """The new tokens `[n]` of one row up to, not including, the first `token_id`."""
    hits = (new == token_id).nonzero()
    return new if hits.numel() == 0 else new[:int(hits[0])]
