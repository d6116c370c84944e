"""Where a step's time and memory go: torch.profiler traces of chosen steps, CUDA allocator
snapshots (also on out-of-memory), and the split of the first step's memory.

The loop calls `StepProfiler.begin(step)` / `end(step)` around every step (1-based: the step
number the metrics log after it). With `profile.steps` empty no profiler is ever built and both
calls return at one set lookup, so an unprofiled run pays nothing measurable.

Traces land in `RUN/profile/step_<n>/rank<R>.pt.trace.json` (n: the range's first step): one
file per rank that is both a Chrome trace (chrome://tracing, ui.perfetto.dev) and what
TensorBoard's profiler plugin reads (`tensorboard --logdir RUN/profile`). Each profiled step is
a `ProfilerStep#<n>` annotation in it (torch's name for step markers, which TensorBoard's step
view and `megabeta bench trace` read). Rank 0 prints the top operators by self time and keeps
that table beside its trace (`top_ops.txt`). Kineto's `USDT: ... profiler_start` and
`profiler_stop` lines, which it prints to stderr at any log level, are left out of the output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from megabeta.config import StepSelection, parse_steps  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from megabeta.config import ProfileConfig

log = logging.getLogger("megabeta")

MEMORY_HISTORY_ENTRIES = 100_000
"""Allocator events kept while recording (torchtitan's default): bounded host memory."""

_KINETO_MARKER = re.compile(
    rb"^(USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] ")
"""Kineto's own marker lines (`USDT:2026-12-06 17:05:29 8132:8132
SyncActivityProfilerHandler.cpp:52] profiler_start`), printed from C++ to the process's stderr
whatever KINETO_LOG_LEVEL says."""


@contextlib.contextmanager
def without_kineto_markers() -> Iterator[None]:
    """Around starting or stopping the profiler: the process's stderr (file descriptor 2) is
    collected meanwhile and written back without kineto's marker lines; anything else written
    to it then (another thread's log line) comes out as it was, after the call."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as collected:
        os.dup2(collected.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            collected.seek(0)
            kept = b"".join(line for line in collected.read().splitlines(keepends=True)
                            if not _KINETO_MARKER.match(line))
            if kept:
                os.write(2, kept)


class StepProfiler:
    """torch.profiler over `profile.steps` on this rank; allocator snapshots on CUDA."""

    def __init__(self, config: ProfileConfig, run_dir: Path, rank: int,
                 device: torch.device) -> None:
        self.config = config
        self.selection = parse_steps(config.steps)
        self.root = run_dir / "profile"
        self.rank = rank
        self.device = device
        self.profiler: torch.profiler.profile | None = None
        self.step_mark: torch.profiler.record_function | None = None
        self.range_start = 0
        # History is recorded from the start, not only over the profiled steps: an out-of-memory
        # error may come at any step, and its snapshot is only useful with the events before it.
        self.snapshots = config.memory_snapshot and device.type == "cuda"
        if config.memory_snapshot and not self.snapshots and rank == 0:
            log.warning("profile.memory_snapshot = true records the CUDA allocator; this run "
                        "is on %s, no snapshot will be written", device.type)
        if self.snapshots:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    def begin(self, step: int) -> None:
        if self.selection is None:
            return
        if self.profiler is None:
            if not self.selection.starts(step):
                return
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities,
                                                   record_shapes=self.config.record_shapes,
                                                   with_stack=self.config.with_stack)
            with without_kineto_markers():
                self.profiler.start()
            self.range_start = step
        # The step's extent in the trace, as torch's own step markers name it.
        self.step_mark = torch.profiler.record_function(f"ProfilerStep#{step}")
        self.step_mark.__enter__()

    def end(self, step: int, *, last: bool = False) -> None:
        """After step `step`; `last`: the run stops now, so an open range is closed."""
        if self.profiler is None:
            return
        if self.step_mark is not None:
            self.step_mark.__exit__(None, None, None)
            self.step_mark = None
        if not (last or self.selection.ends(step)):
            return
        profiler, self.profiler = self.profiler, None
        with without_kineto_markers():
            profiler.stop()
        folder = self.root / f"step_{self.range_start}"
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"rank{self.rank}.pt.trace.json"
        profiler.export_chrome_trace(str(trace))
        if self.snapshots:
            self.dump_snapshot(folder / f"memory_rank{self.rank}.pickle")
        if self.rank == 0:
            table = top_ops_table(profiler, self.device, self.config.top_ops)
            (folder / "top_ops.txt").write_text(table + "\n")
            log.info("profiled steps %d-%d: trace %s (Chrome/Perfetto; tensorboard --logdir "
                     "%s)\n%s", self.range_start, step, trace, self.root, table)

    def dump_snapshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def out_of_memory(self, step: int) -> str:
        """What to tell the user after an out-of-memory error at `step`: the snapshot written
        (profile.memory_snapshot on CUDA), or how to get one."""
        if not self.snapshots:
            return ("set profile.memory_snapshot = true to get an allocator snapshot of the "
                    "failing step")
        path = self.dump_snapshot(self.root / f"oom_rank{self.rank}_step{step}.pickle")
        return f"allocator snapshot in {path} (open it at https://pytorch.org/memory_viz)"

    def close(self) -> None:
        if self.profiler is not None:
            with without_kineto_markers():
                self.profiler.stop()
            self.profiler = None
        if self.snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)


def top_ops_table(profiler: torch.profiler.profile, device: torch.device, rows: int) -> str:
    """The operators with the most self time (device time on CUDA, host time otherwise)."""
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return profiler.key_averages(group_by_input_shape=profiler.record_shapes).table(
        sort_by=key, row_limit=rows)


# ---- the first step's memory ---------------------------------------------------------------------
def _storages(tensors: Iterator[torch.Tensor]) -> dict[int, int]:
    """Bytes per distinct storage (data pointer) among `tensors`, their local shards for DTensors."""
    found: dict[int, int] = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return found


class ActivationCounter:
    """Bytes autograd saves for backward (`saved_tensors_hooks`) in the first micro-batch's
    forward while active, parameters excluded: the activations of one micro-batch. Counting
    stops at the first unpack (that backward has begun; later micro-batches reuse the freed
    addresses). Tensors saved inside activation checkpointing's own hooks are not seen here,
    only what checkpointing keeps (its inputs), as it should be."""

    def __init__(self, model: nn.Module) -> None:
        self.parameters = set(_storages(p.detach() for p in model.parameters()))
        self.seen: dict[int, int] = {}
        self.counting = True
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        self.counting = False
        return t

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.counting and t.device.type != "meta":
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.parameters:
                self.seen[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self) -> "ActivationCounter":
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


def parameter_bytes(model: nn.Module) -> int:
    return sum(_storages(p.detach() for p in model.parameters()).values())


def gradient_bytes(model: nn.Module) -> int:
    return sum(_storages(p.grad for p in model.parameters() if p.grad is not None).values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return sum(_storages(v for state in optimizer.state.values() for v in state.values()
                         if isinstance(v, torch.Tensor)).values())


def memory_split(model: nn.Module, optimizer: torch.optim.Optimizer | None, grads: int,
                 activations: int) -> dict[str, float]:
    """GiB on this rank of parameters, gradients, optimizer state, and one micro-batch's
    activations (`ActivationCounter`)."""
    gib = 2**30
    return {"params_gib": parameter_bytes(model) / gib, "grads_gib": grads / gib,
            "optimizer_gib": optimizer_state_bytes(optimizer) / gib,
            "activations_gib": activations / gib}


__all__ = ["ActivationCounter", "StepProfiler", "StepSelection", "gradient_bytes",
           "memory_split", "parse_steps", "top_ops_table"]
