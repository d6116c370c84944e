"""Learning-rate schedules: linear warmup, then each decay's shape down to its floor."""

from __future__ import annotations

import math

import pytest

from megabeta.config import OptimConfig, ScheduleConfig
from megabeta.train.schedule import lr_at


def schedule(kind: str, **kw) -> list[float]:
    optim = OptimConfig(lr=1.0)
    sched = ScheduleConfig(kind=kind, warmup_steps=4, min_lr_ratio=0.1, **kw)
    return [lr_at(step, 20, optim, sched) for step in range(20)]


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd", "constant"])
def test_warmup_is_linear_to_the_peak(kind: str) -> None:
    assert schedule(kind)[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_decays_end_at_the_floor_and_have_their_shape() -> None:
    cosine, linear = schedule("cosine"), schedule("linear")
    assert cosine[-1] == pytest.approx(0.1) and linear[-1] == pytest.approx(0.1)
    middle = 4 + (20 - 4) // 2 - 1  # halfway through the decay
    assert cosine[middle] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert linear[middle] == pytest.approx(1.0 - 0.9 * 0.5)
    assert all(a >= b for a, b in zip(cosine[3:], cosine[4:]))
    wsd = schedule("wsd", decay_fraction=0.25)
    assert wsd[4:15] == [1.0] * 11 and wsd[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(wsd[15:], wsd[16:]))
    assert schedule("constant")[4:] == [1.0] * 16
