"""A hang watchdog: when a step runs longer than `monitor.hang_seconds`, say which rank holds the
others up and in which collective, and dump every thread's stack on every rank.

The loop marks where each step is (`Watchdog.enter(step, phase)`: a few attribute writes, nothing
more). A thread on each rank wakes a few times per `hang_seconds`; once a step overruns, it

1. dumps all threads' Python stacks (faulthandler) to `RUN/hang/rank<R>_step<n>.txt`, and the
   launch's first report also to stderr (later ones name the file);
2. with several ranks, writes this rank's step and phase to `RUN/hang/` (the run directory is
   shared by the ranks, as checkpoints need; a file works while the process group is stuck, and
   is not the rendezvous store, whose client the main thread may be using) and, on rank 0,
   reads every rank's: the ranks behind the others (an earlier step or phase) are named, with
   the collective the others wait in; ranks that never answer are named as unresponsive. A
   single process waits for no other rank: its report names the phase and the work in it;
3. on NCCL, writes the flight recorder's record of the last collectives
   (`RUN/hang/nccl_trace_rank<R>.pkl`); `enable_flight_recorder` turns the recorder on before
   the process group is made.

It reports once per overrunning step; ending the job is left to the process group's timeout
(or the scheduler), which then has the reports. A reported step that then finishes was slow,
not hung: the watchdog says so once, with the step's time, and from then on waits twice the
slowest such step before it reports, so a limit set below the run's step time does not fire
on every step. The launch's first step is not watched: it builds kernels and compiles, and its
length says nothing about a hang.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("megabeta")

PHASES: dict[str, str] = {
    "data": "none (loading the step's batches)",
    "forward_backward": "the gradient reduction (DDP all_reduce / FSDP all_gather and "
                        "reduce_scatter) or the loss all_reduce",
    "optimizer": "the gradient-norm all_reduce (clip_grad_norm_) and the update",
    "log": "the straggler all_gather and the dials' reductions",
    "eval": "the evaluation's loss all_reduce",
    "checkpoint": "the checkpoint's gathers and barriers",
}
"""A step's phases in order, with the collectives each may wait in."""
ORDER = {name: index for index, name in enumerate(PHASES)}
WORK: dict[str, str] = {
    "data": "loading the step's batches",
    "forward_backward": "the forward and backward passes",
    "optimizer": "the gradient norm and the update",
    "log": "logging and the dials",
    "eval": "the evaluation",
    "checkpoint": "saving the checkpoint",
}
"""What a single process does in each phase (it has no collective to wait in)."""

TRACE_BUFFER_ENTRIES = "2000"
"""Collectives the NCCL flight recorder keeps per rank (torch's docs suggest 2000)."""

ANSWER_SECONDS = 10.0
"""How long rank 0 waits for the other ranks' positions before naming the silent ones."""


def enable_flight_recorder() -> None:
    """Turn on NCCL's flight recorder (must precede the process group; a user's setting wins)."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", TRACE_BUFFER_ENTRIES)


def name_laggards(positions: dict[int, tuple[int, str]], world_size: int) -> str:
    """Which ranks are behind, from every answering rank's (step, phase)."""
    silent = [r for r in range(world_size) if r not in positions]
    parts = []
    if positions:
        key = {r: (step, ORDER.get(phase, len(ORDER))) for r, (step, phase) in positions.items()}
        earliest = min(key.values())
        behind = sorted(r for r, k in key.items() if k == earliest)
        ahead = sorted(r for r in positions if r not in behind)
        step, phase = positions[behind[0]]
        if ahead:
            waiting = positions[ahead[0]][1]
            parts.append(f"rank(s) {behind} are behind, in {phase} of step {step}; rank(s) "
                         f"{ahead} wait in {waiting}: {PHASES.get(waiting, waiting)}")
        else:
            parts.append(f"every answering rank is in {phase} of step {step}, waiting in "
                         f"{PHASES.get(phase, phase)}: a collective that does not complete, or "
                         "every rank slow")
    if silent:
        parts.append(f"rank(s) {silent} did not answer within {ANSWER_SECONDS:.0f} s (dead, or "
                     "stuck holding the interpreter)")
    return "; ".join(parts)


class Watchdog:
    """This rank's hang watchdog (`monitor.hang_seconds` > 0)."""

    def __init__(self, seconds: float, run_dir: Path, rank: int, world_size: int) -> None:
        self.seconds = seconds
        self.limit = seconds
        """The time a step may run before it is reported: `seconds`, or twice the slowest
        reported step that then finished, when that is longer."""
        self.folder = run_dir / "hang"
        self.rank, self.world_size = rank, world_size
        self.step, self.phase, self.since = 0, "data", time.monotonic()
        self.finished: tuple[int, float] = (0, 0.0)
        """The last step that ended, and its seconds."""
        self.first: int | None = None
        self.launched = time.time()
        self.reported = -1
        self.reports = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="megabeta-watchdog", daemon=True)
        self.thread.start()

    def enter(self, step: int, phase: str) -> None:
        """Step `step` (1-based, the one running) is now in `phase`; a new step restarts the
        clock."""
        if step != self.step:
            now = time.monotonic()
            self.finished = (self.step, now - self.since)
            self.since = now
        if self.first is None:
            self.first = step
        self.step, self.phase = step, phase

    def _watch(self) -> None:
        while not self.stop.wait(min(1.0, self.seconds / 4)):
            step, phase, since = self.step, self.phase, self.since
            done, took = self.finished
            if done == self.reported and took > self.limit:
                self._slow_not_hung(done, took)
            if (step not in (self.reported, self.first)
                    and time.monotonic() - since > self.limit):
                self.reported = step
                self.report(step, phase, time.monotonic() - since)

    def _slow_not_hung(self, step: int, took: float) -> None:
        """A reported step finished: a limit below the step time, not a hang."""
        self.limit = 2 * took
        if self.rank == 0:
            log.warning("step %d finished after %.1f s: slow, not hung (monitor.hang_seconds = "
                        "%g is below this run's step time; raise it above the slowest step). "
                        "The watchdog now reports a step only after %.1f s, twice that one.",
                        step, took, self.seconds, self.limit)

    def stacks(self, step: int) -> Path:
        """Where this rank's stacks of `step` go."""
        return self.folder / f"rank{self.rank}_step{step}.txt"

    def report(self, step: int, phase: str, elapsed: float) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        stacks = self.stacks(step)
        with open(stacks, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        self.reports += 1
        # The first report's stacks on stderr too; later ones (a slow run) only in their file.
        where = (f"Every thread's stack below and in {stacks}" if self.reports == 1
                 else f"Every thread's stack in {stacks}")
        limit = (f"monitor.hang_seconds = {self.seconds:g}" if self.limit == self.seconds
                 else f"limit {self.limit:.1f} s: twice the slowest step so far, "
                      f"monitor.hang_seconds = {self.seconds:g}")
        if self.world_size == 1:
            log.error("step %d has run %.1f s (%s), in %s: %s; a single process waits for no "
                      "other rank, so this is slow or stuck work. %s.", step, elapsed, limit,
                      phase, WORK.get(phase, phase), where)
        else:
            log.error("rank %d: step %d has run %.1f s (%s), in %s; it may wait in %s. %s.",
                      self.rank, step, elapsed, limit, phase, PHASES.get(phase, phase), where)
        if self.reports == 1:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self._dump_nccl_trace()
        if self.world_size > 1:
            self._position(step, self.rank).write_text(f"{step} {phase}")
            if self.rank == 0:
                log.error("hang at step %d: %s (stacks: %s)", step,
                          name_laggards(self._positions(step), self.world_size),
                          self.folder / f"rank*_step{step}.txt")

    def _position(self, step: int, rank: int) -> Path:
        return self.folder / f"position_step{step}_rank{rank}.txt"

    def _positions(self, step: int) -> dict[int, tuple[int, str]]:
        """Every rank's (step, phase) that arrives within ANSWER_SECONDS. A rank behind by a
        whole step reports under its own step, so the step before is read too."""
        deadline = time.monotonic() + ANSWER_SECONDS
        found: dict[int, tuple[int, str]] = {}
        while True:
            for rank in range(self.world_size):
                for at in (step, step - 1):
                    path = self._position(at, rank)
                    # Files of an earlier launch of this run (same step, before a resume)
                    # are older than this launch.
                    if rank not in found and path.is_file() and \
                            path.stat().st_mtime >= self.launched:
                        got_step, got_phase = path.read_text().split(" ", 1)
                        found[rank] = (int(got_step), got_phase)
            if len(found) == self.world_size or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def _dump_nccl_trace(self) -> None:
        if not (dist.is_initialized() and dist.get_backend() == "nccl"):
            return
        try:
            trace = torch._C._distributed_c10d._dump_nccl_trace()
        except (AttributeError, RuntimeError) as err:  # a build without the flight recorder
            log.warning("rank %d: no NCCL flight-recorder dump (%s)", self.rank, err)
            return
        (self.folder / f"nccl_trace_rank{self.rank}.pkl").write_bytes(trace)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


__all__ = ["PHASES", "WORK", "Watchdog", "enable_flight_recorder", "name_laggards"]
