"""Weights & Biases beside TensorBoard, offline: the same scalars, and a resumed run continues
the same W&B run."""

from __future__ import annotations

import pytest

from support.train_helpers import TINY, launch

wandb = pytest.importorskip("wandb")


def tensorboard_tags(run_dir) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return set(events.Tags()["scalars"])


def test_wandb_offline_gets_tensorboards_scalars_and_resumes_the_same_run(
        tiny_data, tmp_path, monkeypatch) -> None:
    prefix, _ = tiny_data
    run_dir = tmp_path / "run"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    common = [*TINY, f"--data.path={prefix}", f"--run_dir={run_dir}", "--logging.wandb=true",
              "--logging.wandb_project=megabeta-test", "--checkpoint.interval=0",
              "--eval.batches=1", "--logging.interval=2"]
    launch([*common, "--train.steps=2"])
    run_id = (run_dir / "wandb_id").read_text().strip()
    launch([*common, "--train.steps=4", "--resume=auto"])
    assert (run_dir / "wandb_id").read_text().strip() == run_id
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2, sorted(p.name for p in (run_dir / "wandb").iterdir())
    # Offline W&B keeps its records (protobuf, names stored verbatim) in one .wandb file per
    # launch; a small run fits one block, so every logged name appears in it as written.
    records = b"".join(run.joinpath(f"run-{run_id}.wandb").read_bytes() for run in runs)
    tags = tensorboard_tags(run_dir)
    assert "train/loss" in tags and "dials/mass/layer0/self" in tags and "memory/params_gib" in tags
    missing = sorted(tag for tag in tags if tag.encode() not in records)
    assert not missing, missing
    assert b"dials/lambda" in records  # the histogram
