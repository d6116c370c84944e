"""Batches for the training loop from a sample dataset and a :class:`GlobalSampler`.

:class:`StatefulLoader` wraps a ``torch.utils.data.DataLoader`` (workers and pinned memory as
asked) and advances the sampler's global position when it hands a batch to the caller, not when a
worker prefetches it, so a checkpoint taken after step ``k`` records exactly the samples of steps
``0 … k``. A batch is an int64 tensor ``[B, seq_len + 1]``: inputs ``[:, :-1]``, targets
``[:, 1:]``.

Workers: a sample is a slice of the page cache plus one int64 conversion, so the main process
loads hundreds of millions of tokens per second on the development CPU, and worker processes only
add inter-process copies there (``python -m megabeta.bench data`` measures both). They pay off when
reads stall: a cold page cache or a network file system. ``num_workers`` therefore defaults to 0.
Pinned memory helps only batches bound for a CUDA device: ``pin_memory`` defaults to
``torch.cuda.is_available()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from megabeta.data.blend import SampleDataset
from megabeta.data.sampler import GlobalSampler


def collate_tokens(samples: Sequence[np.ndarray]) -> torch.Tensor:
    """Stack equal-length int64 samples into one ``[B, L]`` tensor with a single copy."""
    return torch.from_numpy(np.stack(samples))


class StatefulLoader:
    """Iterable of this rank's batches; ``state_dict`` is the sampler's global position."""

    def __init__(self, dataset: SampleDataset, sampler: GlobalSampler, batch_size: int, *,
                 num_workers: int = 0, pin_memory: bool | None = None,
                 prefetch_factor: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size}: must be at least 1")
        if len(dataset) != sampler.num_samples:
            raise ValueError(f"sampler covers {sampler.num_samples} samples but the dataset has "
                             f"{len(dataset)}; build the sampler with num_samples=len(dataset)")
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.prefetch_factor = prefetch_factor if num_workers > 0 else None

    def __iter__(self) -> Iterator[torch.Tensor]:
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.sampler,
                            num_workers=self.num_workers, pin_memory=self.pin_memory,
                            prefetch_factor=self.prefetch_factor, collate_fn=collate_tokens)
        step = self.batch_size * self.sampler.world_size
        for batch in loader:
            # Advance before handing the batch over: once the caller holds it, it is consumed.
            end = self.sampler.end
            remaining = step if end is None else end - self.sampler.samples_consumed
            self.sampler.advance(min(step, remaining))
            yield batch

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
