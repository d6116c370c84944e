"""summary.png's accuracy panel (megabeta/ablate/plot.py): an accuracy of 0 is drawn (a bar of
height 0 draws nothing: the marker and the value show it), every bar carries its value, and each
task's chance level is a dashed line."""

from __future__ import annotations

import pytest

from megabeta.ablate.plot import summary_figure, task_chance
from megabeta.ablate.summary import summarize

pytest.importorskip("matplotlib")


def _result(arm: str, accuracy: dict[str, float]) -> dict:
    tasks = {task: {"accuracy": value, "chance": chance}
             for task, (value, chance) in accuracy.items()}
    return {"arm": arm, "seed": 1, "parameters": 1000, "test": {"loss": 2.0, "ppl": 7.4},
            "accuracy": sum(v for v, _ in accuracy.values()) / len(accuracy), "tasks": tasks,
            "train": {"s_per_batch": 0.5, "tokens_per_s": 128.0, "final_loss": 2.1}}


def test_a_zero_accuracy_its_value_and_the_chance_level_are_drawn() -> None:
    results = [_result("standard", {"parity-L8": (0.0, 0.5), "chains-n3": (0.25, 0.1)}),
               _result("beta_1.2_c8", {"parity-L8": (0.5, 0.5), "chains-n3": (0.0, 0.1)})]
    rows = summarize(results, ["standard", "beta_1.2_c8"], reference="standard")
    assert task_chance(results) == {"parity-L8": 0.5, "chains-n3": 0.1}
    figure = summary_figure(rows, {}, chance=task_chance(results))
    score = figure.axes[2]
    # Every arm-task has its value written over it, the zeros included.
    assert sorted(t.get_text() for t in score.texts) == ["0.00", "0.00", "0.25", "0.50"]
    # And a marker at its mean: the two zeros are points on the axis, not empty space.
    points = sorted(float(y) for line in score.lines if line.get_marker() == "o"
                    for y in line.get_ydata())
    assert points == [0.0, 0.0, 0.25, 0.5]
    # Chance: one dashed segment per task at its level (tasks sorted: chains-n3, parity-L8).
    (chance,) = score.collections[-1:]
    segments = [(float(seg[0][0]), float(seg[0][1])) for seg in chance.get_segments()]
    assert [y for _, y in segments] == [0.1, 0.5] and chance.get_label() == "chance"
    assert [t.get_text() for t in score.get_legend().get_texts()] == ["chance"]


def test_the_finished_value_diversity_dial_is_drawn_per_arm() -> None:
    results = [_result("standard", {"chains-n3": (0.25, 0.1)}),
               _result("beta_1.2_c8", {"chains-n3": (0.1, 0.1)})]
    rows = summarize(results, ["standard", "beta_1.2_c8"], reference="standard")
    curves = {"beta_1.2_c8": {"value_cosine": {10: (0.4, 0.3, 0.5), 20: (0.98, 0.97, 0.99)}}}
    cosine = summary_figure(rows, curves).axes[3]
    drawn = [line for line in cosine.lines if len(line.get_xdata()) == 2
             and list(line.get_xdata()) == [10, 20]]
    assert len(drawn) == 1 and list(drawn[0].get_ydata()) == [0.4, 0.98]
    (threshold,) = [line for line in cosine.lines if list(line.get_ydata()) == [0.95, 0.95]]
    assert "collapse" in threshold.get_label()


def test_a_high_start_does_not_flatten_the_training_curves() -> None:
    results = [_result("standard", {"chains-n3": (0.25, 0.1)}),
               _result("beta_1.2_c8", {"chains-n3": (0.1, 0.1)})]
    rows = summarize(results, ["standard", "beta_1.2_c8"], reference="standard")
    steps = range(10, 101, 10)
    curves = {"standard": {"train": {s: (2.0, 2.0, 2.0) for s in steps}},
              "beta_1.2_c8": {"train": {s: ((30.0 if s == 10 else 2.5),) * 3 for s in steps}}}
    low, high = summary_figure(rows, curves).axes[0].get_ylim()
    assert 2.5 < high < 3.0
