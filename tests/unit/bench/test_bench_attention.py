"""The CPU attention benchmark's geometry (megabeta.bench.attention): the keys its FLOPs count,
counted again from an explicit mask of every query's key set, its cells' sources inside the
buffers, and the refusal of a history too short for its cells."""

from __future__ import annotations

import pytest
import torch

from megabeta.bench.attention import Wave


def _mask_keys(wave: Wave) -> int:
    """Per cell, the own keys as a causal n x n mask and each group's rows before the block as
    an n x start block of ones, summed."""
    total = 0
    for start, sources in zip(wave.starts(), wave.sources):
        own = torch.ones(wave.block, wave.block).tril()
        history = torch.ones(wave.block, start * len(sources))
        total += int(own.sum() + history.sum())
    return total


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_visible_keys_are_the_masks(warm: bool) -> None:
    wave = Wave.spread(5, 8, 10, 96, warm=warm)
    assert wave.visible_keys() == _mask_keys(wave)
    standard = Wave(1, 40, 1, 0, ((),), first=0)
    assert standard.visible_keys() == 40 * 41 // 2 == _mask_keys(standard)


def test_cells_read_three_consecutive_layers_inside_the_buffers_before_their_block() -> None:
    wave = Wave.spread(7, 32, 20, 512, warm=False)
    assert wave.starts() == [64, 128, 192, 256, 320, 384, 448]
    # Disjoint sources, as a wave's cells read (no two tasks add into one gradient row); the
    # top cell has two.
    read = [m for sources in wave.sources for m in sources]
    assert len(read) == len(set(read)) == 20 and max(read) == 19
    for sources in wave.sources:
        assert sources == tuple(range(sources[0], sources[0] + len(sources)))
    groups = wave.groups()
    assert len(groups) == 5 * 20
    for i in range(0, len(groups), 5):
        cell, layer, lo, hi, g = groups[i:i + 5]
        assert (lo, hi) == (0, wave.starts()[cell]) and layer == wave.sources[cell][g]
    assert Wave.spread(3, 32, 20, 512, warm=True).sources == ((0, 1, 2),) * 3


def test_a_history_too_short_for_the_cells_is_refused_by_flag() -> None:
    with pytest.raises(SystemExit, match="--length >= 480"):
        Wave.spread(7, 32, 20, 256, warm=False).check()
    with pytest.raises(SystemExit, match="--layers >= 19"):
        Wave.spread(7, 32, 18, 512, warm=False).check()
