"""Mean next-token loss over a dataset: the one evaluation the trainer and `megabeta eval` share."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from megabeta.data import (
    GlobalSampler,
    StatefulLoader,
    batch_documents,
    count_scored,
    split_batch,
)
from megabeta.data.blend import SampleDataset
from megabeta.engine.base import document_kwargs


@torch.no_grad()
def evaluate(loss_of: Callable[..., Tensor], dataset: SampleDataset,
             sampler: GlobalSampler, *,
             batch_size: int, max_batches: int = 0,
             device: torch.device = torch.device("cpu")) -> dict[str, float]:
    """Mean per-token loss over the scored targets of `sampler`'s samples of `dataset` (at most
    `max_batches` batches per rank; 0 = all), summed over every rank of the process group when
    there is one: each batch's mean `loss_of(inputs, targets)` weighted by its scored targets
    (every target when the data has no loss mask); `loss_of` gets `documents=` the batch's
    document ids when the data has them (data.document_mask). Returns loss, perplexity, the
    number of samples and of scored targets."""
    total, scored, samples = 0.0, 0, 0
    for i, batch in enumerate(StatefulLoader(dataset, sampler, batch_size)):
        if max_batches and i >= max_batches:
            break
        count = count_scored(batch)  # on the host, before the batch moves
        batch = batch.to(device)
        inputs, targets = split_batch(batch)
        total += float(loss_of(inputs, targets, **document_kwargs(batch_documents(batch)))) * count
        scored += count
        samples += inputs.shape[0]
    totals = torch.tensor([total, float(scored), float(samples)], dtype=torch.float64,
                          device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    loss = float(totals[0] / max(float(totals[1]), 1.0))
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "samples": int(totals[2]),
            "scored_targets": int(totals[1])}
