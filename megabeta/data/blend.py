"""Weighted blending of several sample datasets, Megatron-style: a fixed interleaving by weight.

Like Megatron-LM's ``BlendedDataset``, the blend is two arrays built once (which dataset serves
blended sample ``i``, and which of its samples) and is deterministic, with no randomness: shuffling
is the sampler's job. The interleaving is stride scheduling: dataset ``j``'s ``k``-th sample is due
at virtual time ``(k + ½) / w_j`` and samples are taken in order of due time (ties to the lower
``j``), so every prefix of ``n`` blended samples holds ``w_j · n`` samples of dataset ``j`` up to
less than the number of datasets.

When any of the datasets has a loss mask the blend hands out :class:`MaskedSample` items
throughout, the unmasked datasets' samples with every target scored, so a batch is always of one
kind. Document ids (``has_documents``) are all or nothing: a blend of datasets with and without
them is refused, since the model would mask some samples and not others.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from megabeta.data.errors import DataError
from megabeta.data.sample import MaskedSample, has_documents, has_loss_mask


class SampleDataset(Protocol):
    """What a blend can hold: indexable samples and a content fingerprint; ``has_loss_mask``
    datasets hand out :class:`MaskedSample` items, the others int64 arrays."""

    fingerprint: str
    has_loss_mask: bool

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray | MaskedSample: ...


def blend_schedule(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, dataset_sample_index)`` of blended samples ``0 … num_samples-1``."""
    w = _normalized(weights)
    counts = [math.ceil(share * num_samples) + 1 for share in w]
    due = np.concatenate([(np.arange(count) + 0.5) / share for count, share in zip(counts, w)])
    # A stable sort keeps the lower dataset first on equal due times.
    order = np.argsort(due, kind="stable")[:num_samples]
    starts = np.cumsum([0] + counts[:-1])
    dataset_index = np.searchsorted(starts, order, side="right") - 1
    return dataset_index.astype(np.int16), order - starts[dataset_index]


def _normalized(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise DataError(f"blend weights {list(weights)}: need one positive finite weight per "
                        "dataset")
    return w / w.sum()


class BlendedDataset:
    """Samples of several datasets interleaved by weight.

    ``weights`` default to the datasets' sizes. ``num_samples`` defaults to the longest blend in
    which no dataset repeats a sample; a larger value repeats the smaller datasets in order (as a
    Megatron blend does over several epochs of a small dataset).
    """

    def __init__(self, datasets: Sequence[SampleDataset], weights: Sequence[float] | None = None,
                 num_samples: int | None = None) -> None:
        if not datasets:
            raise DataError("a blend needs at least one dataset")
        sizes = np.array([len(d) for d in datasets], dtype=np.int64)
        if weights is None:
            weights = sizes.tolist()
        if len(weights) != len(datasets):
            raise DataError(f"{len(weights)} blend weights for {len(datasets)} datasets; give one "
                            "weight per dataset")
        self.datasets = list(datasets)
        self.has_loss_mask = any(has_loss_mask(d) for d in self.datasets)
        self.has_documents = has_documents(self.datasets[0])
        if any(has_documents(d) != self.has_documents for d in self.datasets):
            raise DataError("a blend of datasets with and without document ids: build every "
                            "part with the same data.document_mask")
        self.weights = _normalized(weights)
        if num_samples is None:
            num_samples = self._longest_without_repeats(sizes)
        if num_samples < 1:
            raise DataError(f"blend of {num_samples} samples: must be at least 1")
        self.dataset_index, self.dataset_sample_index = blend_schedule(self.weights, num_samples)
        self.dataset_sample_index %= sizes[self.dataset_index]

    def _longest_without_repeats(self, sizes: np.ndarray) -> int:
        # Overshoot by the deviation bound, then cut at the first sample a dataset lacks.
        guess = int(np.min(np.floor(sizes / self.weights))) + len(sizes)
        owner, local = blend_schedule(self.weights, guess)
        lacking = np.flatnonzero(local >= sizes[owner])
        return int(lacking[0]) if lacking.size else guess

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int) -> np.ndarray | MaskedSample:
        sample = self.datasets[self.dataset_index[index]][int(self.dataset_sample_index[index])]
        if self.has_loss_mask and not isinstance(sample, MaskedSample):
            return MaskedSample.all_scored(sample)
        return sample

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for dataset in self.datasets:
            digest.update(dataset.fingerprint.encode())
        digest.update(f"blend:{self.weights.tolist()}:{len(self)}".encode())
        return digest.hexdigest()
