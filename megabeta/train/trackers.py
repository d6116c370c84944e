"""Where rank 0's scalars and histograms go besides stdout and metrics.jsonl: TensorBoard
(<run_dir>/tb) and, optionally, Weights & Biases. Every tracker gets the same calls.

W&B (`logging.wandb = true`, the `megabeta[wandb]` extra): project and entity from `[logging]`,
the run's name from the run directory, and its id kept in `<run_dir>/wandb_id` so a resumed run
continues the same W&B run. `WANDB_MODE=offline` writes under <run_dir>/wandb without a network.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from megabeta.extras import require

if TYPE_CHECKING:
    from megabeta.config import LoggingConfig


class Tracker(Protocol):
    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Scalars under their full names (`train/loss`, `dials/lambda/layer0/head1`)."""

    def histogram(self, step: int, name: str, values: Tensor) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def histogram(self, step: int, name: str, values: Tensor) -> None:
        self.writer.add_histogram(name, values.detach().float().cpu(), step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, config: LoggingConfig, run_config: dict) -> None:
        wandb = require("wandb", "wandb", "logging.wandb = true")
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.wandb = wandb
        self.run = wandb.init(project=config.wandb_project, entity=config.wandb_entity or None,
                              name=run_dir.resolve().name, id=run_id, resume="allow",
                              dir=str(run_dir), config=run_config)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def histogram(self, step: int, name: str, values: Tensor) -> None:
        self.run.log({name: self.wandb.Histogram(values.detach().float().cpu().numpy())},
                     step=step)

    def close(self) -> None:
        self.run.finish()


def build_trackers(run_dir: Path, config: LoggingConfig, run_config: dict) -> list[Tracker]:
    trackers: list[Tracker] = []
    if config.tensorboard:
        trackers.append(TensorBoardTracker(run_dir))
    if config.wandb:
        trackers.append(WandbTracker(run_dir, config, run_config))
    return trackers


__all__ = ["TensorBoardTracker", "Tracker", "WandbTracker", "build_trackers"]
