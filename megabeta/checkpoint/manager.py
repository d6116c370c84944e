"""Where checkpoints live, how they are made atomic, and the state that rides along.

Layout under `<run_dir>/checkpoints/`:

    step_00000100/            one complete checkpoint
        model/                the backend's shards (DCP files, or a DeepSpeed engine checkpoint)
        train_state.json      step, tokens seen, global data-loader state, model config, backend
        rng/rank_00000.pt     every rank's Python, NumPy, torch (and CUDA) RNG states
    latest                    the name of the newest complete checkpoint

A checkpoint is written under `step_XXXXXXXX.tmp` and renamed once every rank has finished, so a
directory without the suffix is always complete and `latest` never names a partial one. The
newest `keep` are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

FORMAT = "megabeta-checkpoint/1"
STATE_FILE = "train_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory and what to do."""


@dataclass
class TrainState:
    """Everything besides model and optimizer that a resumed run needs."""

    step: int = 0
    """Optimizer steps completed."""
    tokens_seen: int = 0
    """Training tokens consumed by the whole job."""
    data: dict = field(default_factory=dict)
    """The global data-loader (sampler) state."""
    skipped_steps: int = 0
    """Steps skipped for non-finite loss or gradients, in total."""
    backend: str = ""
    world_size: int = 1
    model_config: dict = field(default_factory=dict)
    tokenizer: dict = field(default_factory=dict)
    """The tokenizer the model is trained with: `path` and `sha256` of the run's data.tokenizer,
    else of the one the dataset sidecars name; empty when neither is known (older checkpoints
    lack the field). `megabeta generate` and `megabeta eval` use it and refuse another one."""
    format: str = FORMAT


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_train_state(path: Path) -> TrainState:
    """The TrainState of checkpoint `path`, or CheckpointError saying what is wrong with it."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory; pass "
                              "--resume=auto or the path of a step_* checkpoint directory")
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{path} is not a megabeta checkpoint (no {STATE_FILE}); pass the "
                              "path of a step_* directory under <run_dir>/checkpoints")
    try:
        raw = json.loads(state_file.read_text())
        state = TrainState(**raw)
    except (json.JSONDecodeError, TypeError) as err:
        raise CheckpointError(f"{state_file} is damaged ({err}); resume from an older "
                              "checkpoint with --resume=PATH") from None
    if state.format != FORMAT:
        raise CheckpointError(f"{path} has format {state.format!r}, this megabeta reads {FORMAT!r}")
    if not (path / "model").is_dir() or not any((path / "model").iterdir()):
        raise CheckpointError(f"{path} is incomplete: its model/ shards are missing; delete it "
                              "and resume from an older checkpoint with --resume=PATH")
    return state


class CheckpointManager:
    """Saves, finds and prunes the checkpoints of one run directory."""

    def __init__(self, run_dir: str | Path, keep: int) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self._pending: tuple[Any, Path, Path] | None = None

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("step_*") if p.is_dir() and "." not in p.name
                      and (p / STATE_FILE).is_file())

    def resolve(self, resume: str) -> tuple[Path, TrainState] | None:
        """The checkpoint to resume from and its train state (read once, here): `auto` = the
        newest complete one (None if there is none), else the path `resume` names."""
        if not resume:
            return None
        if resume != "auto":
            path = Path(resume)
            return path, read_train_state(path)
        latest = self.root / "latest"
        if latest.is_file():
            path = self.root / latest.read_text().strip()
            if (path / STATE_FILE).is_file():
                return path, read_train_state(path)
        found = self.complete()
        return (found[-1], read_train_state(found[-1])) if found else None

    def save(self, step: int, state: TrainState, write_model: Callable[[Path], Any],
             async_save: bool = False) -> Path:
        """Write checkpoint `step` (collective). `write_model(dir)` writes the backend's shards and
        may return a future (async DCP); then the rename happens in `finalize`."""
        self.finalize()
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        if _rank() == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # left over by a run that died while saving
            (tmp / "rng").mkdir(parents=True)
            (tmp / "model").mkdir()
        _barrier()
        torch.save(capture_rng(), tmp / "rng" / f"rank_{_rank():05d}.pt")
        future = write_model(tmp / "model")
        if _rank() == 0:
            (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
        self._pending = (future, tmp, final)
        if future is None:
            self.finalize()
        return final

    def finalize(self) -> None:
        """Complete the pending save: wait for it, rename, point `latest` at it, prune."""
        if self._pending is None:
            return
        future, tmp, final = self._pending
        self._pending = None
        if future is not None:
            future.result()
        _barrier()
        if _rank() == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            pointer = self.root / "latest.tmp"
            pointer.write_text(final.name)
            os.replace(pointer, self.root / "latest")
            for old in self.complete()[:-self.keep]:
                shutil.rmtree(old)
        _barrier()

    def load_rng(self, path: Path, world_size: int) -> bool:
        """Restore this rank's RNG states if the checkpoint has them for this world size."""
        files = sorted((path / "rng").glob("rank_*.pt"))
        if len(files) != world_size:
            return False
        restore_rng(torch.load(path / "rng" / f"rank_{_rank():05d}.pt", weights_only=False))
        return True
