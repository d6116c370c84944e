"""The ablation runner's reading of a trainer run (megabeta/ablate/runner.py): the loss curves
and the finished-value diversity dial, the last record of a repeated step winning."""

from __future__ import annotations

import json

from megabeta.ablate.runner import read_curves


def test_read_curves_takes_the_losses_and_the_mean_finished_value_cosine(tmp_path) -> None:
    records = [
        {"step": 1, "loss": 3.0},
        {"step": 1, "split": "dials", "diversity/layer0/value_cosine": 0.2,
         "diversity/layer1/value_cosine": 0.6, "diversity/layer0/key_cosine": 0.9},
        {"step": 2, "loss": 2.5},
        {"step": 2, "split": "eval", "loss": 2.6},
        {"step": 2, "split": "dials", "diversity/layer0/value_cosine": 0.9,
         "diversity/layer1/value_cosine": 0.5},
        {"step": 2, "split": "dials", "diversity/layer0/value_cosine": 1.0,  # a resumed launch
         "diversity/layer1/value_cosine": 0.9},
        {"step": 3, "split": "dials", "mass/layer0/self": 1.0},  # no probe: no diversity
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    curves = read_curves(tmp_path)
    assert curves["train"] == [(1, 3.0), (2, 2.5)] and curves["eval"] == [(2, 2.6)]
    assert [step for step, _ in curves["value_cosine"]] == [1, 2]
    assert [round(v, 12) for _, v in curves["value_cosine"]] == [0.4, 0.95]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    assert read_curves(tmp_path)["value_cosine"] == []
