"""The global sampler (megabeta/data/sampler.py): deterministic shuffling per seed and epoch,
every sample once per epoch across ranks, and a resume at another world size that neither skips
nor repeats."""

from __future__ import annotations

import numpy as np
import pytest

from megabeta.data import DataError, GlobalSampler, epoch_permutation


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
