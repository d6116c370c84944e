"""The ablation at a glance: summary.png beside summary.md (matplotlib, `megabeta[plot]`).

Left: the training loss per arm over the steps, the mean over seeds as a line and the seeds'
min-max as a band. Middle: the held-out loss the same way (the trainer's evaluations every
`--eval-every` steps, on the validation split; with --test-data the final test loss only, as a
point with its min-max bar). Right: each task's accuracy per arm (the mean over seeds, bars from
min to max), or the perplexity when there are no tasks. The arms keep their summary order and one
colour across the panels; the legend names them.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from megabeta.ablate.runner import read_curves, run_name
from megabeta.extras import require

Curve = dict[int, tuple[float, float, float]]
"""step -> (mean, min, max) over seeds."""


def _band(series: list[dict[int, float]]) -> Curve:
    """Mean, min and max over the seeds at the steps every seed logged."""
    if not series:
        return {}
    steps = sorted(set.intersection(*(set(s) for s in series)))
    return {step: (statistics.fmean(s[step] for s in series), min(s[step] for s in series),
                   max(s[step] for s in series)) for step in steps}


def arm_curves(out: Path, rows: list[dict], results: list[dict[str, Any]]
               ) -> dict[str, dict[str, Curve]]:
    """arm -> {"train": Curve, "test": Curve} from the finished runs' metrics.jsonl, the final
    test loss of each run added at its last step."""
    curves: dict[str, dict[str, Curve]] = {}
    for row in rows:
        train, test = [], []
        for seed in row["seeds"]:
            result = next(r for r in results if r["arm"] == row["arm"] and r["seed"] == seed)
            logged = read_curves(out / "runs" / run_name(row["arm"], seed))
            held_out = dict(logged["eval"])
            if result["test"]["loss"] is not None:
                held_out[result["steps"]] = result["test"]["loss"]
            train.append(dict(logged["train"]))
            test.append(held_out)
        curves[row["arm"]] = {"train": _band(train), "test": _band(test)}
    return curves


def summary_figure(rows: list[dict], curves: dict[str, dict[str, Curve]], title: str = ""):
    """The matplotlib Figure of the summary (Agg, never shown); its one legend names the arms."""
    require("matplotlib", "plot", "summary.png of `megabeta ablate`")
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 4.6), dpi=100, layout="constrained")
    train_ax, test_ax, score_ax = figure.subplots(1, 3)
    colours = matplotlib.colormaps["tab10"]
    handles = []
    for index, row in enumerate(rows):
        colour = colours(index % 10)
        label = row["arm"] + (" (reference)" if row["reference"] else "")
        for ax, kind in ((train_ax, "train"), (test_ax, "test")):
            curve = curves.get(row["arm"], {}).get(kind, {})
            if not curve:
                continue
            steps = sorted(curve)
            mean, low, high = ([curve[s][i] for s in steps] for i in range(3))
            if len(steps) == 1:
                line = ax.errorbar(steps, mean, yerr=[[mean[0] - low[0]], [high[0] - mean[0]]],
                                   fmt="o", color=colour, capsize=4)
            else:
                (line,) = ax.plot(steps, mean, color=colour, marker="o" if kind == "test"
                                  else None, markersize=3)
                ax.fill_between(steps, low, high, color=colour, alpha=0.2, linewidth=0)
            if kind == "train":
                line.set_label(label)
                handles.append(line)
    train_ax.set(title="training loss (mean over seeds, min-max band)", xlabel="step",
                 ylabel="loss")
    test_ax.set(title="held-out loss (mean over seeds, min-max)", xlabel="step", ylabel="loss")
    _scores(score_ax, rows, colours)
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(rows), 5))
    if title:
        figure.suptitle(title)
    return figure


def _scores(ax, rows: list[dict], colours) -> None:
    """Task accuracies per arm (grouped bars, min-max whiskers), else perplexity per arm."""
    tasks = sorted({task for row in rows for task in row["task_accuracy"]})
    if not tasks:
        names = [row["arm"] for row in rows]
        spreads = [row["ppl"] for row in rows]
        ax.bar(range(len(rows)), [s.mean or 0.0 for s in spreads],
               yerr=_whiskers(spreads), capsize=4,
               color=[colours(i % 10) for i in range(len(rows))])
        ax.set_xticks(range(len(rows)), names, rotation=20, ha="right")
        ax.set(title="test perplexity (mean over seeds, min-max)", ylabel="perplexity")
        return
    width = 0.8 / max(len(rows), 1)
    for index, row in enumerate(rows):
        spreads = [row["task_accuracy"].get(task) for task in tasks]
        spreads = [s for s in spreads if s is not None]
        positions = [t + (index - (len(rows) - 1) / 2) * width for t in range(len(spreads))]
        ax.bar(positions, [s.mean or 0.0 for s in spreads], width, yerr=_whiskers(spreads),
               capsize=3, color=colours(index % 10))
    ax.set_xticks(range(len(tasks)), tasks, rotation=20, ha="right")
    ax.set(title="task accuracy (mean over seeds, min-max)", ylabel="exact-match accuracy",
           ylim=(0, 1.05))


def _whiskers(spreads: list) -> list[list[float]]:
    """matplotlib's yerr (distances below and above the mean) of min-max spreads."""
    return [[(s.mean - s.min) if s.mean is not None else 0.0 for s in spreads],
            [(s.max - s.mean) if s.mean is not None else 0.0 for s in spreads]]


def write_plot(out: Path, rows: list[dict], results: list[dict[str, Any]],
               title: str = "") -> Path:
    """summary.png under `out` (written atomically); MissingExtra without matplotlib."""
    figure = summary_figure(rows, arm_curves(out, rows, results), title)
    path = out / "summary.png"
    temp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(temp, format="png")
    temp.replace(path)
    return path


__all__ = ["arm_curves", "summary_figure", "write_plot"]
