"""Checkpoints: atomic sharded saves with resume state, and single-file export."""

import warnings

# DCP warns on every single-process save/load that it assumes a single process: that is intended.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)

from megabeta.checkpoint.manager import CheckpointError, CheckpointManager, TrainState

__all__ = ["CheckpointError", "CheckpointManager", "TrainState"]
