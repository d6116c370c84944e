"""The ablation at a glance: summary.png beside summary.md (matplotlib, `megabeta[plot]`).

Left: the training loss per arm over the steps, the mean over seeds as a line and the seeds'
min-max as a band. Middle: the held-out loss the same way (the trainer's evaluations every
`--eval-every` steps, on the validation split; with --test-data the final test loss only, as a
point with its min-max bar). Right: each task's accuracy per arm (the mean over seeds as a bar, a
marker and its value, whiskers from min to max, so an accuracy of 0 shows too) with the task's
chance level as a dashed line, or the perplexity when there are no tasks. Far right: beta_1.2's
finished-value diversity dial over the steps (the mean over layers of the finished values'
cosine between positions, train/dials.py; 1 = every earlier position holds one vector, the
collapse), with the warning's default threshold dashed. The arms keep their summary order and
one colour across the panels; the legend names them.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from megabeta.ablate.runner import read_curves, run_name
from megabeta.config import MonitorConfig
from megabeta.extras import require
from megabeta.storage.durable import AtomicFiles

COLLAPSE_COSINE = MonitorConfig.collapse_cosine
"""The collapse warning's default threshold (`monitor.collapse_cosine`), drawn for reference."""

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
    """arm -> {"train": Curve, "test": Curve, "value_cosine": Curve} from the finished runs'
    metrics.jsonl, the final test loss of each run added at its last step."""
    curves: dict[str, dict[str, Curve]] = {}
    for row in rows:
        train, test, cosine = [], [], []
        for seed in row["seeds"]:
            result = next(r for r in results if r["arm"] == row["arm"] and r["seed"] == seed)
            logged = read_curves(out / "runs" / run_name(row["arm"], seed))
            held_out = dict(logged["eval"])
            if result["test"]["loss"] is not None:
                held_out[result["steps"]] = result["test"]["loss"]
            train.append(dict(logged["train"]))
            test.append(held_out)
            if logged["value_cosine"]:
                cosine.append(dict(logged["value_cosine"]))
        curves[row["arm"]] = {"train": _band(train), "test": _band(test),
                              "value_cosine": _band(cosine)}
    return curves


def task_chance(results: list[dict[str, Any]]) -> dict[str, float]:
    """Each task's chance level, as its results record it (tasks without one left out)."""
    return {task: score["chance"] for result in results
            for task, score in result.get("tasks", {}).items()
            if score.get("chance") is not None}


def summary_figure(rows: list[dict], curves: dict[str, dict[str, Curve]], title: str = "",
                   chance: dict[str, float] | None = None):
    """The matplotlib Figure of the summary (Agg, never shown); its one legend names the arms.
    `chance`: task -> chance level, drawn in the accuracy panel."""
    require("matplotlib", "plot", "summary.png of `megabeta ablate`")
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    figure = Figure(figsize=(20, 4.6), dpi=100, layout="constrained")
    train_ax, test_ax, score_ax, cosine_ax = figure.subplots(1, 4)
    colours = matplotlib.colormaps["tab10"]
    handles = []
    for index, row in enumerate(rows):
        colour = colours(index % 10)
        label = row["arm"] + (" (reference)" if row["reference"] else "")
        for ax, kind in ((train_ax, "train"), (test_ax, "test"), (cosine_ax, "value_cosine")):
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
    _clip_start(train_ax, [curves.get(row["arm"], {}).get("train", {}) for row in rows])
    test_ax.set(title="held-out loss (mean over seeds, min-max)", xlabel="step", ylabel="loss")
    _scores(score_ax, rows, colours, chance or {})
    cosine_ax.axhline(COLLAPSE_COSINE, color="black", linestyle="dashed", linewidth=1,
                      label=f"collapse warning ({COLLAPSE_COSINE})")
    cosine_ax.legend(loc="lower right", fontsize=8)
    cosine_ax.set(title="finished values' cosine between positions\n(dials, mean over layers; "
                  "1 = collapsed)", xlabel="step", ylabel="mean cosine", ylim=(-0.05, 1.05))
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(rows), 5))
    if title:
        figure.suptitle(title)
    return figure


def _clip_start(ax, curves: list[Curve]) -> None:
    """The axis' top at the highest mean after the first tenth of the steps: an arm whose
    first steps' loss is far above the rest (a large initialisation) does not flatten them."""
    later = [mean for curve in curves if curve
             for step, (mean, _, _) in curve.items() if step > max(curve) / 10]
    if later:
        low, high = ax.get_ylim()
        ax.set_ylim(low, min(high, max(later) + 0.1 * (max(later) - low)))


def _scores(ax, rows: list[dict], colours, chance: dict[str, float]) -> None:
    """Task accuracies per arm (grouped bars with a marker and the value on each, min-max
    whiskers, each task's chance level dashed), else perplexity per arm."""
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
        shown = [(t, row["task_accuracy"][task]) for t, task in enumerate(tasks)
                 if row["task_accuracy"].get(task) is not None
                 and row["task_accuracy"][task].mean is not None]
        if not shown:
            continue
        positions = [t + (index - (len(rows) - 1) / 2) * width for t, _ in shown]
        means = [spread.mean for _, spread in shown]
        colour = colours(index % 10)
        # A bar of height 0 draws nothing: the marker and the value show an accuracy of 0.
        ax.bar(positions, means, width, yerr=_whiskers([s for _, s in shown]), capsize=3,
               color=colour)
        ax.plot(positions, means, "o", color=colour, markeredgecolor="black", markersize=5,
                clip_on=False)
        for x, mean in zip(positions, means):
            ax.annotate(f"{mean:.2f}", (x, mean), xytext=(0, 4), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8)
    marked = [(t, chance[task]) for t, task in enumerate(tasks) if task in chance]
    if marked:
        ax.hlines([level for _, level in marked], [t - 0.45 for t, _ in marked],
                  [t + 0.45 for t, _ in marked], colors="black", linestyles="dashed",
                  linewidth=1, label="chance")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xticks(range(len(tasks)), tasks, rotation=20, ha="right")
    ax.set(title="task accuracy (mean over seeds, min-max)",
           ylabel="exact-match accuracy", ylim=(0, 1.1))


def _whiskers(spreads: list) -> list[list[float]]:
    """matplotlib's yerr (distances below and above the mean) of min-max spreads."""
    return [[(s.mean - s.min) if s.mean is not None else 0.0 for s in spreads],
            [(s.max - s.mean) if s.mean is not None else 0.0 for s in spreads]]


def write_plot(out: Path, rows: list[dict], results: list[dict[str, Any]],
               title: str = "") -> Path:
    """summary.png under `out` (written atomically); MissingExtra without matplotlib."""
    figure = summary_figure(rows, arm_curves(out, rows, results), title, task_chance(results))
    path = out / "summary.png"
    with AtomicFiles([path]) as files:
        figure.savefig(files.temp(path), format="png")
        files.commit()
    return path


__all__ = ["arm_curves", "summary_figure", "task_chance", "write_plot"]
