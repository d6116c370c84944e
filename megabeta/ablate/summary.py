"""The ablation's summary: one row per arm over its seeds, the reference arm first.

Each metric is reported as mean ± spread over the seeds that finished, the spread being the
sample standard deviation (n - 1 in the denominator; none with one seed); the CSV and JSON also
give min and max. Deltas against the reference arm are paired by seed (the same seed is the same
data order and the same initialisation draw): the mean ± standard deviation of arm - reference
over the seeds both have. Written as summary.md, summary.csv and summary.json.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megabeta.storage.durable import write_durably

METRICS = ("test_loss", "ppl", "accuracy", "s_per_batch", "tokens_per_s", "final_train_loss")
"""Per-run figures summarised over seeds (accuracy: the mean over tasks, task datasets only)."""


@dataclass(frozen=True)
class Spread:
    """mean, sample standard deviation (None for one value), min, max and count of some values."""

    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    n: int

    @classmethod
    def of(cls, values: list[float | None]) -> "Spread":
        values = [v for v in values if v is not None and math.isfinite(v)]
        if not values:
            return cls(None, None, None, None, 0)
        std = statistics.stdev(values) if len(values) > 1 else None
        return cls(statistics.fmean(values), std, min(values), max(values), len(values))

    def format(self, digits: int = 4, signed: bool = False) -> str:
        if self.mean is None:
            return "–"
        sign = "+" if signed else ""
        text = f"{self.mean:{sign}.{digits}f}"
        return text if self.std is None else f"{text} ± {self.std:.{digits}f}"


def run_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """The summarised figures of one result.json."""
    tasks = {name: score.get("accuracy") for name, score in result.get("tasks", {}).items()}
    train = result.get("train", {})
    return {"test_loss": result["test"]["loss"], "ppl": result["test"]["ppl"],
            "accuracy": result.get("accuracy"), "s_per_batch": train.get("s_per_batch"),
            "tokens_per_s": train.get("tokens_per_s"),
            "final_train_loss": train.get("final_loss"), "tasks": tasks}


def summarize(results: list[dict[str, Any]], arms: list[str], reference: str) -> list[dict]:
    """One row per arm of `arms` (reference first, then in order): parameters, seeds done, a
    Spread per metric and per task accuracy, and the paired deltas against the reference."""
    by_arm: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in arms}
    params: dict[str, int] = {}
    for result in results:
        if result["arm"] in by_arm:
            by_arm[result["arm"]][result["seed"]] = run_metrics(result)
            params[result["arm"]] = result["parameters"]
    tasks = sorted({t for runs in by_arm.values() for m in runs.values() for t in m["tasks"]})
    ordered = [reference, *[a for a in arms if a != reference]]
    ref_runs = by_arm.get(reference, {})
    rows = []
    for arm in ordered:
        runs = by_arm[arm]
        seeds = sorted(runs)
        row: dict[str, Any] = {"arm": arm, "reference": arm == reference,
                               "parameters": params.get(arm), "seeds": seeds}
        for metric in METRICS:
            row[metric] = Spread.of([runs[s][metric] for s in seeds])
        row["task_accuracy"] = {t: Spread.of([runs[s]["tasks"].get(t) for s in seeds])
                                for t in tasks}
        paired = [s for s in seeds if s in ref_runs]
        for metric in ("test_loss", "accuracy"):
            row[f"delta_{metric}"] = Spread.of([
                None if runs[s][metric] is None or ref_runs[s][metric] is None
                else runs[s][metric] - ref_runs[s][metric] for s in paired])
        rows.append(row)
    return rows


def _has_accuracy(rows: list[dict]) -> bool:
    return any(row["accuracy"].n for row in rows)


def markdown(rows: list[dict], header: dict[str, Any]) -> str:
    """The summary table in Markdown, after the settings (`header`: name -> value)."""
    lines = [f"# Ablation: {header.get('suite') or 'arms'}", ""]
    lines += [f"- **{key}**: {value}" for key, value in header.items()]
    accuracy = _has_accuracy(rows)
    tasks = sorted({t for row in rows for t in row["task_accuracy"]})
    # What the test loss is over: the header's account (the held-out set and whether a loss
    # mask scores only the answers), not assumed from the presence of task accuracies.
    test_loss = header.get("test loss", "mean over the scored targets of the held-out set")
    lines += ["", "± is the sample standard deviation over seeds (n − 1); Δ columns are paired "
              f"by seed against the reference arm (marked *). Test loss: {test_loss}"
              + ("; accuracy: exact match per answer of the task files, averaged over the tasks"
                 if accuracy else "; perplexity = exp(loss)")
              + ". s/batch: mean over the logged training steps but the first; tokens/s = "
              "global batch x seq_len / s/batch.", ""]
    columns = ["arm", "parameters", "seeds", "test loss", "Δ loss"]
    columns += ["accuracy", "Δ accuracy", *tasks] if accuracy else ["perplexity"]
    columns += ["s/batch", "tokens/s", "final train loss"]
    lines += ["| " + " | ".join(columns) + " |",
              "|" + "|".join("---" if c == "arm" else "---:" for c in columns) + "|"]
    for row in rows:
        cells = [row["arm"] + (" *" if row["reference"] else ""),
                 f"{row['parameters']:,}" if row["parameters"] else "–",
                 str(len(row["seeds"])), row["test_loss"].format(4),
                 "ref" if row["reference"] else row["delta_test_loss"].format(4, signed=True)]
        if accuracy:
            cells += [row["accuracy"].format(3),
                      "ref" if row["reference"] else row["delta_accuracy"].format(3, signed=True)]
            cells += [row["task_accuracy"][t].format(3) if t in row["task_accuracy"] else "–"
                      for t in tasks]
        else:
            cells.append(row["ppl"].format(2))
        cells += [row["s_per_batch"].format(3), row["tokens_per_s"].format(0),
                  row["final_train_loss"].format(4)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def csv_text(rows: list[dict]) -> str:
    """One CSV row per arm: every Spread as NAME_mean, NAME_std, NAME_min, NAME_max."""
    tasks = sorted({t for row in rows for t in row["task_accuracy"]})
    spreads = [*METRICS, "delta_test_loss", "delta_accuracy", *(f"acc:{t}" for t in tasks)]
    header = ["arm", "reference", "parameters", "seeds"]
    header += [f"{name}_{part}" for name in spreads for part in ("mean", "std", "min", "max")]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        cells: list[Any] = [row["arm"], int(row["reference"]), row["parameters"] or "",
                            " ".join(map(str, row["seeds"]))]
        for name in spreads:
            spread = (row["task_accuracy"].get(name[4:], Spread.of([]))
                      if name.startswith("acc:") else row[name])
            cells += ["" if v is None else repr(float(v))
                      for v in (spread.mean, spread.std, spread.min, spread.max)]
        writer.writerow(cells)
    return out.getvalue()


def as_json(rows: list[dict], header: dict[str, Any], results: list[dict]) -> dict[str, Any]:
    def plain(value: Any) -> Any:
        if isinstance(value, Spread):
            return value.__dict__.copy()
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    per_run = [{"arm": r["arm"], "seed": r["seed"], "parameters": r["parameters"],
                **{k: v for k, v in run_metrics(r).items()}} for r in results]
    return {"header": header, "spread": "sample standard deviation over seeds (n - 1)",
            "rows": [plain(row) for row in rows], "runs": per_run}


def write_summary(out: Path, rows: list[dict], header: dict[str, Any],
                  results: list[dict]) -> list[Path]:
    """summary.md, summary.csv and summary.json under `out` (each written atomically)."""
    from megabeta.ablate.runner import write_json_atomic

    paths = [out / "summary.md", out / "summary.csv", out / "summary.json"]
    write_durably(paths[0], markdown(rows, header))
    write_durably(paths[1], csv_text(rows))
    write_json_atomic(paths[2], as_json(rows, header, results))
    return paths


__all__ = ["Spread", "summarize", "markdown", "csv_text", "write_summary", "run_metrics",
           "METRICS"]
