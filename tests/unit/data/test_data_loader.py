"""The loader (megabeta/data/loader.py): its state counts the batches handed out, not those
prefetched, and resumes exactly."""

from __future__ import annotations

import pytest
import torch
from support.data_helpers import write_dataset

from megabeta.data import GlobalSampler, IndexedDataset, PackedDataset, StatefulLoader


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_state_counts_batches_handed_out_and_resumes_exactly(tmp_path, num_workers):
    packed = PackedDataset(IndexedDataset(write_dataset(tmp_path / "ds", [50] * 20)), seq_len=16)
    world, batch = 2, 3

    def loader(rank: int) -> StatefulLoader:
        sampler = GlobalSampler(len(packed), world, rank, seed=4, fingerprint=packed.fingerprint)
        return StatefulLoader(packed, sampler, batch, num_workers=num_workers)

    reference = loader(0)
    batches = []
    for step, tensor in enumerate(reference):
        assert tensor.shape == (batch, 17) and tensor.dtype == torch.int64
        batches.append(tensor)
        # workers prefetch ahead, yet the state counts only what was handed out
        assert reference.state_dict()["samples_consumed"] == (step + 1) * batch * world
        if step == 1:
            saved = reference.state_dict()
        if step == 4:
            break
    resumed = loader(0)
    resumed.load_state_dict(saved)
    again = [tensor for _, tensor in zip(range(3), resumed)]
    for expected, got in zip(batches[2:], again):
        assert torch.equal(expected, got)
