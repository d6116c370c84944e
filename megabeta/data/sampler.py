"""Deterministic shuffling and a distributed sampler whose position is global.

All ranks share one stream of sample indices: epoch ``e`` is a permutation of ``0 … N-1`` fixed by
``(seed, e)``, and the epochs follow each other. The only state is the number of samples the whole
job has consumed (plus the seed and a fingerprint of the data, to refuse a resume onto other data).
Rank ``r`` of ``W`` reads global positions ``consumed + r, consumed + r + W, …``, so a step of
local batch ``B`` consumes the next ``B · W`` positions of the stream whatever ``W`` is. That is
why a run resumed at another world size neither skips nor repeats a sample: the state does not
mention ranks at all.

Iterating does not move the position (a DataLoader prefetches ahead of training); whoever hands
batches to the training loop calls :meth:`GlobalSampler.advance` -- :class:`megabeta.data.loader.
StatefulLoader` does.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from megabeta.data.errors import DataError


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The order of an epoch: a permutation of ``0 … num_samples-1`` fixed by ``(seed, epoch)``.

    Uses NumPy's legacy ``RandomState`` (Mersenne Twister), whose streams NumPy keeps stable across
    releases, seeded with the pair so that distinct pairs never share an order by construction.
    """
    if not 0 <= seed < 2**32 or not 0 <= epoch < 2**32:
        raise DataError(f"seed {seed} and epoch {epoch} must lie in [0, 2**32)")
    # uint32 halves the memory of int64 for any realistic sample count; the draws are the same.
    order = np.arange(num_samples, dtype=np.uint32 if num_samples < 2**32 else np.int64)
    np.random.RandomState([seed, epoch]).shuffle(order)
    return order


class GlobalSampler:
    """Sample indices for one rank from the job-wide stream; see the module docstring.

    ``num_epochs`` None makes the stream endless (train by step count); an integer ends it after
    that many epochs, and then the ranks' last batches may differ by one sample.
    """

    def __init__(self, num_samples: int, world_size: int = 1, rank: int = 0, seed: int = 0, *,
                 shuffle: bool = True, fingerprint: str = "",
                 num_epochs: int | None = None) -> None:
        if num_samples < 1:
            raise DataError(f"num_samples {num_samples}: a sampler needs at least one sample")
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} of world size {world_size}: need 0 <= rank < world_size")
        if num_epochs is not None and num_epochs < 1:
            raise DataError(f"num_epochs {num_epochs}: must be at least 1 (or None for no end)")
        epoch_permutation(0, seed, 0)  # validates the seed now rather than mid-run
        self.num_samples = num_samples
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.fingerprint = fingerprint
        self.num_epochs = num_epochs
        self.samples_consumed = 0
        self._cached_epoch: tuple[int, np.ndarray] | None = None

    @property
    def epoch(self) -> int:
        return self.samples_consumed // self.num_samples

    @property
    def end(self) -> int | None:
        """Global position where the stream stops (None: endless)."""
        return None if self.num_epochs is None else self.num_epochs * self.num_samples

    def sample_at(self, position: int) -> int:
        """Sample index at global stream position ``position``."""
        epoch, offset = divmod(position, self.num_samples)
        if not self.shuffle:
            return offset
        if self._cached_epoch is None or self._cached_epoch[0] != epoch:
            self._cached_epoch = (epoch, epoch_permutation(self.num_samples, self.seed, epoch))
        return int(self._cached_epoch[1][offset])

    def __iter__(self) -> Iterator[int]:
        position = self.samples_consumed + self.rank
        end = self.end
        while end is None or position < end:
            yield self.sample_at(position)
            position += self.world_size

    def __len__(self) -> int:
        """Samples this rank still yields; only defined when ``num_epochs`` ends the stream."""
        if self.end is None:
            raise TypeError("an endless GlobalSampler (num_epochs=None) has no length")
        remaining = self.end - self.samples_consumed - self.rank
        return max(0, -(-remaining // self.world_size))

    def advance(self, global_samples: int) -> None:
        """Record that the whole job (all ranks together) consumed ``global_samples`` more."""
        if global_samples < 0:
            raise ValueError(f"cannot advance by {global_samples} samples")
        self.samples_consumed += global_samples
        if self.end is not None:
            self.samples_consumed = min(self.samples_consumed, self.end)

    def state_dict(self) -> dict:
        """The job-wide position: identical on every rank, independent of the world size."""
        return {
            "samples_consumed": self.samples_consumed,
            "epoch": self.epoch,
            "samples_consumed_in_epoch": self.samples_consumed % self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; DataError if it was saved for other data, seed or shuffling."""
        for key in ("num_samples", "fingerprint", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise DataError(
                    f"sampler state: {key} was {state.get(key)!r} when saved, this run has "
                    f"{getattr(self, key)!r}; resume with the same data, seq_len, blend and seed, "
                    "or start the data stream afresh instead of loading the saved data state")
        consumed = int(state["samples_consumed"])
        if consumed < 0 or (consumed // self.num_samples, consumed % self.num_samples) != (
                state.get("epoch"), state.get("samples_consumed_in_epoch")):
            raise DataError(f"sampler state: samples_consumed {consumed} disagrees with epoch "
                            f"{state.get('epoch')} and samples_consumed_in_epoch "
                            f"{state.get('samples_consumed_in_epoch')}; the saved state is damaged")
        self.samples_consumed = consumed if self.end is None else min(consumed, self.end)
