"""Readers of pre-tokenized, memory-mapped token datasets (written by ``megabeta-data tokenize``).

Public API (documented in ``docs/data.md``):

- :class:`IndexedDataset` -- zero-copy reader of a Megatron-compatible ``PREFIX.bin/.idx`` pair.
- :class:`PackedDataset` -- ``seq_len + 1``-token samples across document boundaries;
  :class:`DocumentDataset` -- samples aligned to document starts, padded and masked past the end;
  :class:`BlockAlignedDataset` -- packed, each document starting at a multiple of the block size.
- :class:`MaskedSample`, :class:`MaskedBatch` -- samples and batches of datasets with loss masks;
  :func:`split_batch`, :func:`batch_documents`, :func:`count_scored` read a batch of either kind.
- :func:`split_documents` -- train/validation split by document ranges.
- :class:`BlendedDataset` -- Megatron-style weighted blend of several sample datasets.
- :func:`epoch_permutation`, :class:`GlobalSampler` -- seeded shuffling; a distributed sampler
  whose state is global (samples consumed, seed, epoch, data fingerprint).
- :class:`StatefulLoader` -- DataLoader batches that advance the sampler when handed out.
- :func:`build_train_val` -- prefixes to train/validation datasets in one call;
  :func:`build_run_data` -- the same from a run's [data] settings, as the trainer calls it.
- :class:`DataError` -- every data problem, with a message naming the file and the fix.
- :mod:`megabeta.data.format` -- the on-disk format, shared with the writer in ``data_tools``.
"""

from megabeta.data.blend import BlendedDataset, blend_schedule
from megabeta.data.build import TrainValData, build_run_data, build_train_val
from megabeta.data.errors import DataError
from megabeta.data.format import file_sha256
from megabeta.data.indexed import IndexedDataset
from megabeta.data.packed import BlockAlignedDataset, DocumentDataset, PackedDataset
from megabeta.data.sample import MaskedSample
from megabeta.data.sampler import GlobalSampler, epoch_permutation
from megabeta.data.split import split_documents

__all__ = [
    "BlendedDataset",
    "BlockAlignedDataset",
    "DataError",
    "DocumentDataset",
    "GlobalSampler",
    "IndexedDataset",
    "MaskedBatch",
    "MaskedSample",
    "PackedDataset",
    "StatefulLoader",
    "TrainValData",
    "batch_documents",
    "blend_schedule",
    "build_run_data",
    "build_train_val",
    "collate_tokens",
    "count_scored",
    "epoch_permutation",
    "file_sha256",
    "split_batch",
    "split_documents",
]


def __getattr__(name: str):
    # The loader needs torch; importing it lazily keeps `megabeta-data` and its worker processes,
    # which only need the format, free of torch's import time.
    if name in ("StatefulLoader", "MaskedBatch", "batch_documents", "collate_tokens",
                "count_scored", "split_batch"):
        from megabeta.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
