"""Where checkpoints live, how they are made atomic, and the state that rides along.

Layout under `<run_dir>/checkpoints/`:

    step_00000100/            one complete checkpoint
        model/                the backend's shards (DCP files, or a DeepSpeed engine checkpoint)
        train_state.json      step, tokens seen, global data-loader state, model config, backend
        rng/rank_00000.pt     every rank's Python, NumPy, torch (and CUDA) RNG states, as
                              tensors and numbers (loaded with weights_only: storage/safe_load.py)
    latest                    the name of the newest complete checkpoint

A checkpoint is written under `step_XXXXXXXX.tmp` and renamed once every rank has finished, so a
directory without the suffix is always complete and `latest` never names a partial one. The
newest `keep` are kept. The commit is durable (storage/durable.py), in the order databases use: every
file is fsynced by the rank that wrote it (DCP syncs its shards, the DeepSpeed engine its own
files), then rank 0 fsyncs the directories, renames the checkpoint into place and fsyncs its
parent, then writes `latest` the same way (temporary file, fsync, rename, fsync). A crash at any
point leaves the previous `latest` naming a checkpoint whose data is on disk.

Files can still be lost or cut short afterwards (a full disk, a partial copy, a purge).
`check_checkpoint` finds that cheaply, from sizes and headers only: every shard file that the DCP
`model/.metadata` names present and at least as long as the data it places in it (a DeepSpeed
engine checkpoint: its model and optimizer files present, non-empty, with an intact zip
directory), `train_state.json` readable, one readable RNG file per rank. `--resume=auto` skips a
damaged checkpoint with a warning saying what is wrong with it and takes the newest usable one;
an explicit `--resume=PATH` to a damaged one is an error naming the file and the alternatives.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from megabeta.storage.durable import (fsync_directories, fsync_path, replace_durably,
                                         write_durably, write_synced)
from megabeta.storage.safe_load import SafeFileSystemReader

FORMAT = "megabeta-checkpoint/1"
STATE_FILE = "train_state.json"
DCP_METADATA = ".metadata"
DEEPSPEED_TAG = "engine"
"""The tag the DeepSpeed engine saves under: model/engine/*."""

log = logging.getLogger("megabeta")


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
    schedule_horizon: int = 0
    """Steps the learning-rate schedule decayed over (schedule.total_steps, else train.steps);
    0 in older checkpoints. A resumed run warns when its own horizon differs."""


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as tensors, numbers and strings only, so that they load with
    `weights_only=True` (no pickled objects to run code from)."""
    version, mt_state, gauss_next = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "numpy": {"bit_generator": numpy_state["bit_generator"],
                  "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                  "pos": int(numpy_state["state"]["pos"]),
                  "has_gauss": int(numpy_state["has_gauss"]),
                  "gauss": float(numpy_state["gauss"])},
        "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    python, numpy_state = state["python"], state["numpy"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss_next"]))
    np.random.set_state({"bit_generator": numpy_state["bit_generator"],
                         "state": {"key": numpy_state["key"].numpy().astype(np.uint32),
                                   "pos": numpy_state["pos"]},
                         "has_gauss": numpy_state["has_gauss"], "gauss": numpy_state["gauss"]})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_NUMPY_ARRAY_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
                        getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct]
"""What a NumPy array in an RNG file of the first format (`np.random.get_state()`'s tuple) needs
to unpickle: array reconstruction only."""


def load_rng_file(file: Path) -> dict[str, Any]:
    """The RNG states in `file`, loaded with `weights_only=True`; CheckpointError when it holds
    anything but tensors, numbers and NumPy arrays (it could run code) or is not in this format.
    Files of the first format (Python and NumPy states as their own tuples) are converted."""
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            state = torch.load(file, weights_only=True)
    except pickle.UnpicklingError as err:
        reason = str(err).splitlines()[0].split(". ")[0]
        raise CheckpointError(f"{file} holds objects other than RNG states ({reason}); refusing "
                              "to load it: it could run code. Resume from a checkpoint your own "
                              "runs wrote") from None
    if isinstance(state, dict) and isinstance(state.get("python"), tuple):
        state = _from_first_format(state)
    if not (isinstance(state, dict) and isinstance(state.get("python"), dict)
            and isinstance(state.get("numpy"), dict) and "torch" in state):
        raise CheckpointError(f"{file} is not a megabeta RNG state file (expected python, numpy "
                              "and torch states); resume from a checkpoint this megabeta wrote")
    return state


def _from_first_format(state: dict[str, Any]) -> dict[str, Any]:
    version, mt_state, gauss_next = state["python"]
    _, key, pos, has_gauss, gauss = state["numpy"]
    return {**state,
            "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64),
                       "gauss_next": gauss_next},
            "numpy": {"bit_generator": "MT19937", "key": torch.from_numpy(key.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}}


def read_train_state(path: Path) -> TrainState:
    """The TrainState of checkpoint `path`, or CheckpointError saying what is wrong with it."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory; pass "
                              "--resume=auto or the path of a step_* checkpoint directory")
    state_file = path / STATE_FILE
    if not state_file.is_file():
        if path.name.startswith("step_") and (path / "model").is_dir():
            raise CheckpointError(f"{state_file} is missing: the checkpoint is incomplete or "
                                  "damaged")
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


def check_checkpoint(path: Path) -> TrainState:
    """The TrainState of checkpoint `path` after a cheap check of its files (sizes and headers,
    no tensor data read); CheckpointError naming the first missing or damaged file."""
    state = read_train_state(path)
    problem = _model_damage(path / "model", state) or _rng_damage(path / "rng", state.world_size)
    if problem:
        # files inside the checkpoint are named relative to it: model/__0_0.distcp
        problem = problem.replace(f"{path}{os.sep}", "")
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    return state


def _model_damage(model: Path, state: TrainState) -> str | None:
    if state.backend == "deepspeed":
        return _deepspeed_damage(model / DEEPSPEED_TAG, state.world_size)
    return _dcp_damage(model)


def _dcp_damage(model: Path) -> str | None:
    """What is wrong with the DCP checkpoint in `model` (None: every shard its metadata names
    is there, as long as the data placed in it)."""
    metadata_file = model / DCP_METADATA
    if not metadata_file.is_file():
        return f"{metadata_file} is missing (it lists the shards and what is in them)"
    try:
        metadata = SafeFileSystemReader(str(model)).read_metadata()
        storage = dict(metadata.storage_data or {})
    except Exception as err:  # noqa: BLE001 - an unreadable pickle raises anything
        return f"{metadata_file} cannot be read ({type(err).__name__}: {_first_line(err)})"
    if not storage:
        return f"{metadata_file} names no shard data"
    needed: dict[str, int] = {}
    for item in storage.values():
        end = int(item.offset) + int(item.length)
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), end)
    for name in sorted(needed):
        shard = model / name
        if not shard.is_file():
            return f"{shard} is missing ({metadata_file} places data in it)"
        size = shard.stat().st_size
        if size < needed[name]:
            return (f"{shard} is truncated: {size} bytes, but {metadata_file} places data up to "
                    f"byte {needed[name]} in it")
    return None


def _deepspeed_damage(engine: Path, world_size: int) -> str | None:
    """What is wrong with the DeepSpeed engine checkpoint in `engine` (None: model states there,
    one optimizer-state file per rank, every file non-empty with an intact zip directory)."""
    if not engine.is_dir():
        return f"{engine} is missing (the DeepSpeed engine checkpoint)"
    files = sorted(engine.glob("*.pt"))
    if not any(f.name.endswith("model_states.pt") for f in files):
        return f"{engine} holds no *model_states.pt file"
    optim_ranks = {int(m.group(1)) for f in files
                   if f.name.endswith("optim_states.pt")
                   and (m := re.search(r"zero_pp_rank_(\d+)_", f.name))}
    missing = sorted(set(range(world_size)) - optim_ranks)
    if optim_ranks and missing:
        return (f"{engine} has no optimizer states of rank {missing[0]} "
                f"(*zero_pp_rank_{missing[0]}_*optim_states.pt; the run had {world_size} ranks)")
    for file in files:
        problem = _torch_file_damage(file, full=False)
        if problem:
            return problem
    return None


def _rng_damage(rng: Path, world_size: int) -> str | None:
    for rank in range(world_size):
        file = rng / f"rank_{rank:05d}.pt"
        if not file.is_file():
            return f"{file} is missing (the RNG states of rank {rank})"
        problem = _torch_file_damage(file, full=True)
        if problem:
            return problem
    return None


def _torch_file_damage(file: Path, full: bool) -> str | None:
    """A torch.save file is a zip archive: empty, truncated (no central directory at the end) or,
    with `full`, a member failing its CRC is damage. Nothing is unpickled."""
    if file.stat().st_size == 0:
        return f"{file} is empty"
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip() if full else None
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"{file} is truncated or damaged ({_first_line(err)})"
    if bad is not None:
        return f"{file} is damaged (member {bad} fails its checksum)"
    return None


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else type(err).__name__


def describe_load_error(err: BaseException) -> str:
    """One line for a failed engine load: the underlying exception, not DCP's multi-rank
    traceback text (its CheckpointException's message embeds every rank's traceback)."""
    failures = getattr(err, "failures", None)
    where = ""
    if isinstance(failures, dict) and failures:
        rank, (err, _) = min(failures.items(), key=lambda kv: kv[0])
        where = f" on rank {rank}"
    text = _first_line(err)
    if isinstance(err, pickle.UnpicklingError):
        # torch's weights-only message goes on to advise weights_only=False: not the point here
        text = "stored bytes that do not unpickle (" + text.split(". ")[0].rstrip(".") + ")"
    return f"{type(err).__name__}{where}: {text}"


def _step_dirs(directory: Path) -> list[Path]:
    """The `step_*` checkpoint directories in `directory` (not the `.tmp` ones), oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob("step_*") if p.is_dir() and "." not in p.name)


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
        """The checkpoint to resume from and its train state (read once, here), each checked with
        `check_checkpoint`. `auto` = the newest usable one in this run directory (None if there is
        none; damaged newer ones are skipped with a warning; CheckpointError if every one is
        damaged), else the path `resume` names (CheckpointError naming the damaged file and the
        usable checkpoints there are)."""
        if not resume:
            return None
        if resume != "auto":
            path = Path(resume)
            try:
                return path, check_checkpoint(path)
            except CheckpointError as err:
                raise CheckpointError(f"{err}{self.alternatives_hint(path)}") from None
        skipped: list[str] = []
        for path in reversed(_step_dirs(self.root)):
            try:
                state = check_checkpoint(path)
            except CheckpointError as err:
                skipped.append(path.name)
                if _rank() == 0:
                    log.warning("--resume=auto: skipping %s: %s", path.name, err)
                continue
            if skipped and _rank() == 0:
                log.warning("--resume=auto: resuming from %s, the newest usable checkpoint "
                            "(skipped: %s)", path, ", ".join(skipped))
            return path, state
        if skipped:
            raise CheckpointError(f"--resume=auto: no usable checkpoint in {self.root} (damaged: "
                                  f"{', '.join(skipped)}; the warnings above say why); move them "
                                  "away to start afresh, or pass --resume=PATH")
        return None

    def usable_alternatives(self, path: Path) -> list[Path]:
        """Checkpoints other than `path`, next to it or in this run directory, that pass
        `check_checkpoint`; newest first."""
        seen: dict[Path, Path] = {}
        for directory in (Path(path).parent, self.root):
            for candidate in _step_dirs(directory):
                seen.setdefault(candidate.resolve(), candidate)
        here = Path(path).resolve()
        usable = []
        for key, candidate in seen.items():
            if key == here:
                continue
            try:
                check_checkpoint(candidate)
            except CheckpointError:
                continue
            usable.append(candidate)
        return sorted(usable, key=lambda p: p.name, reverse=True)

    def alternatives_hint(self, path: Path) -> str:
        """`; usable checkpoints: ...` for an error message about `path`."""
        usable = self.usable_alternatives(path)
        if not usable:
            return (f"; no other usable checkpoint next to it or in {self.root}: start afresh "
                    "without --resume")
        listed = ", ".join(str(p) for p in usable[:3])
        more = f" (and {len(usable) - 3} older)" if len(usable) > 3 else ""
        return f"; usable checkpoints: {listed}{more}: pass one with --resume=PATH"

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
        buffer = io.BytesIO()
        torch.save(capture_rng(), buffer)
        write_synced(tmp / "rng" / f"rank_{_rank():05d}.pt", buffer.getvalue())
        future = write_model(tmp / "model")
        if _rank() == 0:
            write_synced(tmp / STATE_FILE, json.dumps(asdict(state), indent=1).encode())
        self._pending = (future, tmp, final)
        if future is None:
            self.finalize()
        return final

    def finalize(self) -> None:
        """Complete the pending save: wait for it, make it durable and rename it (module doc),
        point `latest` at it, prune."""
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
            fsync_directories(tmp)
            replace_durably(tmp, final)
            fsync_path(self.root.parent)  # the entry of checkpoints/ itself, made at the first save
            write_durably(self.root / "latest", final.name.encode())
            for old in self.complete()[:-self.keep]:
                shutil.rmtree(old)
        _barrier()

    def load_rng(self, path: Path, world_size: int) -> bool:
        """Restore this rank's RNG states if the checkpoint has them for this world size."""
        files = sorted((path / "rng").glob("rank_*.pt"))
        if len(files) != world_size:
            return False
        restore_rng(load_rng_file(path / "rng" / f"rank_{_rank():05d}.pt"))
        return True
