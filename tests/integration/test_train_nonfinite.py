"""Non-finite loss or gradients: the step is skipped (no update), counted and logged; a run of
them stops the training with a clear message."""

from __future__ import annotations

import math

import pytest
import torch

from megabeta.config import load_config
from megabeta.train.loop import Trainer, TrainingStopped
from support.train_helpers import TINY_CONFIG, TINY_OVERRIDES, snapshot_steps, train_records


def poisoned_trainer(tiny_data, run_dir, poisoned_steps, *extra: str) -> Trainer:
    """A single-process trainer whose gradients (and loss) turn NaN at the given 0-based steps."""
    prefix, _ = tiny_data
    config = load_config(TINY_CONFIG, [*TINY_OVERRIDES, f"--data.path={prefix}", f"--run_dir={run_dir}",
                                "--checkpoint.save_at_end=false", *extra])
    trainer = Trainer(config)
    clean = trainer.engine.forward_backward

    def forward_backward(*args, **kwargs):
        loss = clean(*args, **kwargs)
        if trainer.state.step in poisoned_steps:
            for p in trainer.engine.model.parameters():
                p.grad.fill_(math.nan)
            return loss * math.nan
        return loss

    trainer.engine.forward_backward = forward_backward
    return trainer


def test_nonfinite_step_is_skipped_counted_and_logged(tiny_data, tmp_path) -> None:
    trainer = poisoned_trainer(tiny_data, tmp_path, poisoned_steps={2})
    snapshots = snapshot_steps(trainer)
    trainer.train()
    records = train_records(tmp_path)
    assert [r["skipped"] for r in records] == [0, 0, 1, 1, 1, 1]
    assert math.isnan(records[2]["loss"]) and all(math.isfinite(r["loss"]) for r in records[3:])
    # The skipped step (index 2) left every parameter as step index 1 had made it.
    assert all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2]))
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3]))


def test_a_run_of_nonfinite_steps_stops_training(tiny_data, tmp_path) -> None:
    trainer = poisoned_trainer(tiny_data, tmp_path, range(1, 100), "--train.max_nonfinite=3")
    with pytest.raises(TrainingStopped, match="3 non-finite steps in a row.*at step 4"):
        trainer.train()
