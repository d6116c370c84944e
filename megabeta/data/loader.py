"""Batches for the training loop from a sample dataset and a :class:`GlobalSampler`.

:class:`StatefulLoader` wraps a ``torch.utils.data.DataLoader`` (workers and pinned memory as
asked) and advances the sampler's global position when it hands a batch to the caller, not when a
worker prefetches it, so a checkpoint taken after step ``k`` records exactly the samples of steps
``0 … k``. A batch is an int64 tensor ``[B, seq_len + 1]``: inputs ``[:, :-1]``, targets
``[:, 1:]``; for a dataset with loss masks (``has_loss_mask``) it is a :class:`MaskedBatch` of
inputs and targets, the unscored targets ``IGNORE_INDEX``, and, for a dataset with document ids
(``has_documents``), the int32 ids ``[B, seq_len]`` of the inputs' documents (spec §7).
:func:`split_batch`, :func:`batch_documents` and :func:`count_scored` read either kind.

Workers: a sample is a slice of the page cache plus one int64 conversion, so the main process
loads hundreds of millions of tokens per second on the development CPU, and worker processes only
add inter-process copies there (``python -m megabeta.bench data`` measures both). They pay off when
reads stall: a cold page cache or a network file system. ``num_workers`` therefore defaults to 0.
Pinned memory helps only batches bound for a CUDA device: ``pin_memory`` defaults to
``torch.cuda.is_available()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from megabeta.data.blend import SampleDataset
from megabeta.data.sample import MaskedSample
from megabeta.data.sampler import GlobalSampler
from megabeta.model.loss import IGNORE_INDEX


class MaskedBatch(NamedTuple):
    """A batch of masked samples. A named tuple, so DataLoader's pinning handles it."""

    inputs: torch.Tensor
    """int64 [B, seq_len]"""
    targets: torch.Tensor
    """int64 [B, seq_len]; IGNORE_INDEX where the mask is 0"""
    documents: torch.Tensor | None = None
    """int32 [B, seq_len]: each input's document id, non-decreasing along a row, unique within
    a row only (:attr:`MaskedSample.documents`); None without data.document_mask"""

    def to(self, device: torch.device, non_blocking: bool = False) -> MaskedBatch:
        return MaskedBatch(*(None if t is None else t.to(device, non_blocking=non_blocking)
                             for t in self))


Batch = torch.Tensor | MaskedBatch
"""What a :class:`StatefulLoader` yields: ``[B, seq_len + 1]`` tokens, or a :class:`MaskedBatch`."""


def collate_tokens(samples: Sequence[np.ndarray] | Sequence[MaskedSample]) -> Batch:
    """Stack equal-length int64 samples into one ``[B, L]`` tensor with a single copy; masked
    samples into inputs and targets, the targets of mask 0 set to ``IGNORE_INDEX``, and their
    document ids when they carry them."""
    if not isinstance(samples[0], MaskedSample):
        return torch.from_numpy(np.stack(samples))
    tokens = np.stack([s.tokens for s in samples])
    scored = np.stack([s.mask[1:] for s in samples]) != 0
    documents = None
    if samples[0].documents is not None:
        documents = torch.from_numpy(np.stack([s.documents for s in samples]))
    return MaskedBatch(torch.from_numpy(tokens[:, :-1].copy()),
                       torch.from_numpy(np.where(scored, tokens[:, 1:], IGNORE_INDEX)), documents)


def split_batch(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of a batch of either kind."""
    if isinstance(batch, MaskedBatch):
        return batch.inputs, batch.targets
    return batch[:, :-1], batch[:, 1:]


def batch_documents(batch: Batch) -> torch.Tensor | None:
    """The document ids ``[B, seq_len]`` of a batch, None when its data emits none."""
    return batch.documents if isinstance(batch, MaskedBatch) else None


def count_scored(batch: Batch) -> int:
    """Scored targets of a batch: all of a plain one (read from its shape, no data touched), the
    non-``IGNORE_INDEX`` ones of a masked one (a sync if it is on an accelerator: count before
    moving it)."""
    if isinstance(batch, MaskedBatch):
        return int((batch.targets != IGNORE_INDEX).sum())
    return batch.shape[0] * (batch.shape[1] - 1)


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

    def __iter__(self) -> Iterator[Batch]:
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
