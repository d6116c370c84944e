"""megabeta.bench.host: the graphed pass's replays per micro-step, counted through the CPU
stand-in at two lengths, and the command's errors."""

from __future__ import annotations

import pytest

from megabeta.bench import host


def test_a_graphed_micro_step_replays_two_graphs_at_any_length() -> None:
    result = host.measure("graphed", blocks=(2, 5))
    assert result["replays"] == {2: 2, 5: 2}


def test_eager_launches_are_counted_for_the_longer_step() -> None:
    """Launches of the 2-block step (8 cells): a few dozen a cell, the count deterministic."""
    first, second = (host.measure("eager", blocks=(1, 2), repeats=1, warmup=0)
                     for _ in range(2))
    assert first["cells"] == 2 * 4 and first["launches"] == second["launches"]
    assert 20 * first["cells"] < first["launches"] < 80 * first["cells"]


@pytest.mark.parametrize("argv, named", [(["--modes", "eager,fast"], "--modes"),
                                         (["--blocks", "5,3"], "--blocks"),
                                         (["--blocks", "a"], "--blocks"),
                                         (["--repeats", "0"], "--repeats")])
def test_bad_input_names_the_flag(argv: list[str], named: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        host.main(argv)
    assert info.value.code == 2 and named in capsys.readouterr().err
