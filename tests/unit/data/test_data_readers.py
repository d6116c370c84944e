"""Readers: packing, split, blending, deterministic shuffling, the global sampler and the loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from data_tools.writer import IndexedDatasetWriter
from megabeta.data import (
    BlendedDataset,
    DataError,
    GlobalSampler,
    IndexedDataset,
    PackedDataset,
    StatefulLoader,
    blend_schedule,
    build_train_val,
    epoch_permutation,
    split_documents,
)

EOS = 2


def write_dataset(prefix: Path, lengths: list[int], first_id: int = 10,
                  vocab_size: int = 1000) -> Path:
    """Documents of the given lengths (EOS last), ids counting up from ``first_id`` (mod vocab)."""
    docs = []
    next_id = first_id
    for length in lengths:
        body = [(next_id + i) % (vocab_size - 10) + 10 for i in range(length - 1)]
        next_id += length - 1
        docs.append(body + [EOS])
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(np.array(sum(docs, []), dtype=np.uint16), np.array(lengths))
        writer.commit({"tokenizer": {"sha256": "abc", "vocab_size": vocab_size, "eos_id": EOS,
                                     "pad_id": 0, "bos_id": 1, "unk_id": 3},
                       "append_eos": True})
    return prefix


@pytest.fixture
def dataset(tmp_path) -> IndexedDataset:
    return IndexedDataset(write_dataset(tmp_path / "ds", [5, 9, 3, 12, 7, 4, 8, 6, 10, 11]))


def test_packed_samples_cover_the_stream_across_documents(dataset):
    packed = PackedDataset(dataset, seq_len=8)
    stream = np.asarray(dataset.tokens, dtype=np.int64)
    assert len(packed) == (dataset.num_tokens - 1) // 8
    for i in range(len(packed)):
        sample = packed[i]
        assert sample.dtype == np.int64 and sample.shape == (9,)
        assert np.array_equal(sample, stream[8 * i:8 * i + 9])
        if i:
            assert sample[0] == packed[i - 1][-1]  # each target token appears exactly once
    assert any(EOS in packed[i][1:-1] for i in range(len(packed)))  # crosses document ends
    with pytest.raises(IndexError):
        packed[len(packed)]


def test_split_by_document_ranges(dataset):
    train, val = split_documents(10, 0.25)
    assert (train, val) == (range(0, 7), range(7, 10))
    assert split_documents(10, 0.0) == (range(0, 10), range(10, 10))
    start, middle = dataset.document_token_range(train.start, train.stop)
    middle_again, end = dataset.document_token_range(val.start, val.stop)
    assert start == 0 and middle == middle_again == sum([5, 9, 3, 12, 7, 4, 8])
    assert end == dataset.num_tokens
    with pytest.raises(DataError, match="leave none for training"):
        split_documents(3, 0.9)
    with pytest.raises(DataError, match=r"must be in \[0, 1\)"):
        split_documents(3, 1.0)


def test_build_train_val_keeps_validation_documents_out_of_training(tmp_path):
    prefix = write_dataset(tmp_path / "ds", [40] * 20)
    data = build_train_val([prefix], seq_len=16, val_fraction=0.1)
    assert (data.train.start, data.train.end) == (0, 18 * 40)
    assert (data.val.start, data.val.end) == (18 * 40, 20 * 40)
    assert data.vocab_size == 1000 and data.tokenizer_sha256 == "abc"
    assert data.special_ids == {"pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3}
    assert build_train_val([prefix], seq_len=16).val is None


def test_blend_follows_the_weights(tmp_path):
    weights = [0.5, 0.3, 0.2]
    owner, local = blend_schedule(weights, 10000)
    counts = np.bincount(owner, minlength=3)
    assert np.all(np.abs(counts - np.array(weights) * 10000) <= 1)
    for n in (1, 7, 100, 333, 4321):  # every prefix is close, not only the whole
        prefix_counts = np.bincount(owner[:n], minlength=3)
        assert np.all(np.abs(prefix_counts - np.array(weights) * n) < 3)
    for j in range(3):  # each dataset's samples in order, none skipped
        assert np.array_equal(local[owner == j], np.arange(counts[j]))


def test_blended_dataset_serves_the_right_samples_without_repeats(tmp_path):
    parts = [PackedDataset(IndexedDataset(write_dataset(tmp_path / f"d{j}", [30] * n,
                                                        first_id=100 * j)), seq_len=10)
             for j, n in enumerate([10, 4])]
    blend = BlendedDataset(parts, weights=[0.5, 0.5])
    pairs = list(zip(blend.dataset_index.tolist(), blend.dataset_sample_index.tolist()))
    assert len(set(pairs)) == len(pairs) == len(blend)
    assert sum(1 for j, _ in pairs if j == 1) == len(parts[1])  # ends when the smaller runs out
    for i, (j, k) in enumerate(pairs):
        assert np.array_equal(blend[i], parts[j][k])
    by_size = BlendedDataset(parts)
    counts = np.bincount(by_size.dataset_index, minlength=2)
    assert abs(counts[0] / counts.sum() - len(parts[0]) / (len(parts[0]) + len(parts[1]))) < 0.05
    with pytest.raises(DataError, match="one weight per dataset"):
        BlendedDataset(parts, weights=[1.0])
    with pytest.raises(DataError, match="positive finite weight"):
        BlendedDataset(parts, weights=[1.0, 0.0])


def test_build_train_val_blends_several_datasets(tmp_path):
    prefixes = [write_dataset(tmp_path / f"d{j}", [33] * 30, first_id=50 * j) for j in range(2)]
    data = build_train_val(prefixes, weights=[3, 1], seq_len=8, val_fraction=0.1)
    assert isinstance(data.train, BlendedDataset) and isinstance(data.val, BlendedDataset)
    share = np.bincount(data.train.dataset_index, minlength=2) / len(data.train)
    assert abs(share[0] - 0.75) < 0.01
    with pytest.raises(DataError, match="2 weights for 1 datasets"):
        build_train_val(prefixes[:1], weights=[1, 2], seq_len=8)


def test_epoch_permutation_is_fixed_by_seed_and_epoch():
    order = epoch_permutation(1000, seed=3, epoch=0)
    assert sorted(order.tolist()) == list(range(1000))
    assert np.array_equal(order, epoch_permutation(1000, seed=3, epoch=0))
    assert not np.array_equal(order, epoch_permutation(1000, seed=4, epoch=0))
    assert not np.array_equal(order, epoch_permutation(1000, seed=3, epoch=1))
    # seed 3 epoch 1 is not seed 4 epoch 0: the pair seeds the generator, not their sum
    assert not np.array_equal(epoch_permutation(1000, 3, 1), epoch_permutation(1000, 4, 0))


def read_all(samplers: list[GlobalSampler]) -> list[list[int]]:
    return [list(sampler) for sampler in samplers]


def test_every_sample_exactly_once_per_epoch_across_ranks():
    for world in (1, 2, 3, 4):
        samplers = [GlobalSampler(10, world, rank, seed=5, num_epochs=1) for rank in range(world)]
        per_rank = read_all(samplers)
        flat = [i for part in per_rank for i in part]
        assert sorted(flat) == list(range(10))
        assert [len(part) for part in per_rank] == [len(s) for s in samplers]
        assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1


def test_identical_order_for_a_seed():
    one = list(GlobalSampler(50, seed=11, num_epochs=1))
    assert one == list(GlobalSampler(50, seed=11, num_epochs=1))
    assert one != list(GlobalSampler(50, seed=12, num_epochs=1))
    assert one == epoch_permutation(50, 11, 0).tolist()
    assert list(GlobalSampler(50, shuffle=False, num_epochs=1)) == list(range(50))


def test_endless_stream_is_a_fresh_permutation_each_epoch():
    sampler = GlobalSampler(7, world_size=2, rank=0, seed=1)
    other = GlobalSampler(7, world_size=2, rank=1, seed=1)
    stream = [0] * 28
    for position, (a, b) in enumerate(zip(sampler, other)):
        if position == 14:
            break
        stream[2 * position], stream[2 * position + 1] = a, b
    for epoch in range(4):
        assert stream[7 * epoch:7 * epoch + 7] == epoch_permutation(7, 1, epoch).tolist()


@pytest.mark.parametrize("new_world", [1, 3])
def test_resume_at_another_world_size_neither_skips_nor_repeats(new_world):
    total, consumed = 41, 14
    first = [GlobalSampler(total, 2, rank, seed=9, fingerprint="fp", num_epochs=1)
             for rank in range(2)]
    seen = []
    for rank, sampler in enumerate(first):
        seen += list(sampler)[:consumed // 2]
    for sampler in first:
        sampler.advance(consumed)
    state = first[0].state_dict()
    assert state == first[1].state_dict()
    assert (state["samples_consumed"], state["epoch"], state["seed"]) == (consumed, 0, 9)
    resumed = [GlobalSampler(total, new_world, rank, seed=9, fingerprint="fp", num_epochs=1)
               for rank in range(new_world)]
    for sampler in resumed:
        sampler.load_state_dict(state)
    per_rank = read_all(resumed)
    rest = [i for part in per_rank for i in part]
    assert len(rest) == total - consumed
    assert sorted(seen + rest) == list(range(total))
    # Interleaved by rank, the continuation is the uninterrupted stream's remainder, in order.
    stream = [per_rank[j % new_world][j // new_world] for j in range(total - consumed)]
    assert stream == epoch_permutation(total, 9, 0).tolist()[consumed:]


def test_state_refuses_other_data_or_seed():
    state = GlobalSampler(20, seed=1, fingerprint="a").state_dict()
    with pytest.raises(DataError, match="fingerprint was 'a' when saved"):
        GlobalSampler(20, seed=1, fingerprint="b").load_state_dict(state)
    with pytest.raises(DataError, match="seed was 1 when saved"):
        GlobalSampler(20, seed=2, fingerprint="a").load_state_dict(state)
    with pytest.raises(DataError, match="num_samples was 20"):
        GlobalSampler(21, seed=1, fingerprint="a").load_state_dict(state)
    broken = {**state, "samples_consumed": 25}
    with pytest.raises(DataError, match="disagrees with epoch"):
        GlobalSampler(20, seed=1, fingerprint="a").load_state_dict(broken)


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


def test_blended_fingerprint_changes_with_weights(tmp_path):
    parts = [PackedDataset(IndexedDataset(write_dataset(tmp_path / f"d{j}", [30] * 10)), 8)
             for j in range(2)]
    assert BlendedDataset(parts, [1, 1]).fingerprint != BlendedDataset(parts, [2, 1]).fingerprint
    assert BlendedDataset(parts, [1, 1]).fingerprint == BlendedDataset(parts, [1, 1]).fingerprint
