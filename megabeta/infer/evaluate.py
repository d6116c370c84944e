"""Mean next-token loss over a dataset: the one evaluation the trainer and `megabeta eval` share."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from megabeta.data import GlobalSampler, StatefulLoader
from megabeta.data.blend import SampleDataset


@torch.no_grad()
def evaluate(loss_of: Callable[[Tensor, Tensor], Tensor], dataset: SampleDataset,
             sampler: GlobalSampler, *,
             batch_size: int, max_batches: int = 0,
             device: torch.device = torch.device("cpu")) -> dict[str, float]:
    """Sample-weighted mean of `loss_of(inputs, targets)` over `sampler`'s samples of `dataset`
    (at most `max_batches` batches per rank; 0 = all), summed over every rank of the process
    group when there is one. Returns loss, perplexity and the number of samples."""
    total, count = 0.0, 0
    for i, batch in enumerate(StatefulLoader(dataset, sampler, batch_size)):
        if max_batches and i >= max_batches:
            break
        batch = batch.to(device)
        total += float(loss_of(batch[:, :-1], batch[:, 1:])) * batch.shape[0]
        count += batch.shape[0]
    totals = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    loss = float(totals[0] / max(float(totals[1]), 1.0))
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "samples": int(totals[1])}
