"""The pass's plan (model/plan.py, spec §5): waves at a period, units of waves."""

from __future__ import annotations

import pytest

from megabeta.model.plan import WavePlan, period


@pytest.mark.parametrize("blocks,layers,window", [(1, 3, 2), (5, 3, 0), (6, 4, 1), (7, 20, 2),
                                                  (4, 3, 5), (3, 1, 0)])
@pytest.mark.parametrize("schedule", ["block", "wavefront"])
def test_every_cell_runs_once_after_what_it_reads(blocks: int, layers: int, window: int,
                                                 schedule: str) -> None:
    """Every (block, layer) cell runs exactly once, after cell (b, l-1) and after every
    finished K/V it reads (cells (b-1, m), m ≤ top(l)); the cells of one wave are oldest first,
    on consecutive blocks, at layers stepping down by the period."""
    plan = WavePlan(blocks, layers, period(schedule, layers, window))
    when: dict[tuple[int, int], int] = {}
    for t in range(plan.waves):
        wave = plan.wave(t)
        cells = wave.cells
        assert cells, t
        assert [b for b, _ in cells] == list(range(cells[0][0], cells[0][0] + len(cells)))
        assert all(a - b == plan.period for a, b in zip(wave.layers, wave.layers[1:]))
        for cell in cells:
            assert cell not in when
            when[cell] = t
    assert sorted(when) == [(b, l) for b in range(blocks) for l in range(layers)]
    for (b, l), t in when.items():
        if l > 0:
            assert when[(b, l - 1)] < t
        if b > 0:
            assert when[(b - 1, min(l + window, layers - 1))] < t
    assert plan.waves == (blocks - 1) * plan.period + layers


@pytest.mark.parametrize("blocks,layers,window", [(5, 3, 1), (4, 4, 3), (1, 2, 0)])
def test_units_cover_the_waves_in_order(blocks: int, layers: int, window: int) -> None:
    """The block schedule's unit is a block (its L waves, one cell each), the wavefront's one
    wave; a unit publishes every cell but the last block's."""
    for schedule in ("block", "wavefront"):
        plan = WavePlan(blocks, layers, period(schedule, layers, window))
        units = plan.units()
        waves = [w for u in units for w in u.waves]
        assert waves == [plan.wave(t) for t in range(plan.waves)]
        published = [cell for u in units for cell in u.published]
        assert sorted(published) == [(b, l) for b in range(blocks - 1) for l in range(layers)]
        entering = [b for u in units for b in u.entering]
        exiting = [b for u in units for b in u.exiting]
        assert entering == exiting == list(range(blocks))
        if plan.period == layers:
            assert all(len(u.waves) == layers and len({w.first for w in u.waves}) == 1
                       for u in units)
            assert not any(u.joined or u.joins for u in units)


@pytest.mark.parametrize("blocks,layers,window", [(5, 3, 1), (6, 4, 2), (4, 2, 0), (3, 5, 3)])
def test_an_entering_block_joins_the_state_the_wave_before_hands_on(blocks: int, layers: int,
                                                                    window: int) -> None:
    """A block enters alone only where no state is handed to its first wave (the first
    wave); otherwise the wave before, which hands on a state, projects it at its end
    (`joining`), and the next unit knows it (`joined`)."""
    plan = WavePlan(blocks, layers, period("wavefront", layers, window))
    units = plan.units()
    waves = [plan.wave(t) for t in range(plan.waves)]
    for t, (unit, wave) in enumerate(zip(units, waves)):
        alone, joins = unit.enters_alone(0), unit.joining(0)
        assert alone == (wave.enters and t == 0)
        assert joins == (t + 1 < len(waves) and waves[t + 1].enters)
        if joins:
            assert wave.continues and unit.entering[-1] == waves[t + 1].cells[-1][0]
            assert units[t + 1].joined and not units[t + 1].enters_alone(0)
        assert unit.kind[1:] == (unit.joined, unit.joins)


def test_kinds_of_unit() -> None:
    """Every block of the block schedule is one kind (one compiled graph); the wavefront's
    steady state repeats its p kinds."""
    assert WavePlan(8, 4, 4).kinds() == WavePlan(2, 4, 4).kinds() == 1
    short, long = WavePlan(6, 4, 2), WavePlan(40, 4, 2)
    assert short.kinds() == long.kinds() <= 3 * 4 + 2


def test_periods_outside_the_plan_are_refused() -> None:
    with pytest.raises(ValueError, match="period 5 outside"):
        WavePlan(3, 4, 5)
    assert period("block", 4, 1) == 4 and period("wavefront", 4, 1) == 2
    assert period("wavefront", 4, 9) == 4  # k beyond L - 1 is L - 1
