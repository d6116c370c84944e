"""What a sample dataset hands out when its targets carry a loss mask.

A dataset whose tokens are all scored hands out plain int64 arrays of ``seq_len + 1`` tokens, as it
always has (the cheap path, no mask built). A dataset with a mask (``PREFIX.mask``, or
document-aligned samples whose padding is masked) hands out a :class:`MaskedSample` instead, and
says so with ``has_loss_mask``; the loader's collate turns its zeros into ``IGNORE_INDEX`` targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MaskedSample:
    """``seq_len + 1`` tokens and their mask: ``mask[i] == 1`` when token ``i`` is a scored target
    (predicted from tokens ``0 … i-1``). ``mask[0]`` is carried along but never used: the first
    token of a sample is no target."""

    tokens: np.ndarray
    """int64 [seq_len + 1]"""
    mask: np.ndarray
    """uint8 [seq_len + 1]"""

    @classmethod
    def all_scored(cls, tokens: np.ndarray) -> MaskedSample:
        """A sample of an unmasked dataset in a blend with masked ones: every target scored."""
        return cls(tokens, np.ones(len(tokens), dtype=np.uint8))


def has_loss_mask(dataset: object) -> bool:
    """Whether ``dataset`` hands out :class:`MaskedSample` items (datasets that predate masks
    and do not say are unmasked)."""
    return bool(getattr(dataset, "has_loss_mask", False))
