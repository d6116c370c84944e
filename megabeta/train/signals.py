"""Preemption: stop at a step boundary when the scheduler or the user asks, on every rank alike.

SLURM sends SIGTERM at the time limit or on scancel (then SIGKILL after KillWait, 30 s by default),
SIGUSR1 ahead of the limit when asked (``--signal=USR1@N``), and a user presses Ctrl-C (SIGINT).
Stopping in the middle of a step would leave a checkpoint no one can resume from, and a rank that
stops alone leaves the others hanging in their next collective: so the handler only records the
signal, and `PreemptionHandler.should_stop` turns it into one decision shared by all ranks at the
same step boundary. Typical use::

    with PreemptionHandler() as preempt:
        for step in range(start, steps):
            train_step()
            if preempt.should_stop():
                save_checkpoint()
                maybe_requeue(cfg.requeue)
                break
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable
from types import FrameType, TracebackType
from typing import Any, Union

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_Handler = Union[Callable[[int, Union[FrameType, None]], Any], int]


class PreemptionHandler:
    """Record stop signals; `should_stop` agrees on them across ranks.

    `received` is the first signal this process got (None if none). While stopping, a second
    SIGINT restores the previous SIGINT handler and re-delivers itself to it, so Ctrl-C twice
    still kills a run whose last step or checkpoint hangs.
    """

    def __init__(self, signals: Iterable[signal.Signals] = STOP_SIGNALS) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler must be created in the main thread: "
                               "Python delivers signals only there")
        self.received: signal.Signals | None = None
        self._agreed: signal.Signals | None = None
        self._previous: dict[signal.Signals, _Handler] = {}
        for sig in signals:
            previous = signal.signal(sig, self._on_signal)
            # None: the handler was not set from Python; SIG_DFL is the closest we can restore.
            self._previous[sig] = signal.SIG_DFL if previous is None else previous

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only set flags here: logging or collectives inside a signal handler can deadlock.
        if signum == signal.SIGINT and self.stopping:
            self._escalate(frame)
        elif self.received is None:
            self.received = signal.Signals(signum)

    def _escalate(self, frame: FrameType | None) -> None:
        previous = self._previous.pop(signal.SIGINT)
        signal.signal(signal.SIGINT, previous)
        if callable(previous):
            previous(signal.SIGINT, frame)  # Python's default raises KeyboardInterrupt
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)

    @property
    def stopping(self) -> bool:
        """A signal arrived here, or `should_stop` has already said stop."""
        return self.received is not None or self._agreed is not None

    def should_stop(self) -> bool:
        """Whether to stop after the step just finished; the same answer on every rank.

        With a process group this is a collective (an all_reduce of one number): every rank must
        call it at the same step boundaries. Once it has said True it keeps saying so without
        communicating, since every rank learned the answer at the same call.
        """
        if self._agreed is not None:
            return True
        code = 0 if self.received is None else int(self.received)
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([code], dtype=torch.int32, device=_collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        if code == 0:
            return False
        self._agreed = signal.Signals(code)
        where = "" if self.received is not None else " on another rank"
        log.info("%s received%s: stopping at this step boundary", self._agreed.name, where)
        return True

    def close(self) -> None:
        """Put back the handlers found at creation, unless someone replaced ours since."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> PreemptionHandler:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _collective_device() -> torch.device:
    """NCCL reduces only CUDA tensors; gloo reduces CPU ones."""
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def maybe_requeue(enabled: bool) -> bool:
    """Under SLURM, put this job back in the queue once every rank is done; True if SLURM accepted.

    Call it on every rank, last, after the checkpoint is written: SLURM sends SIGTERM to every
    process as soon as it requeues the job, so with a process group this first waits for all ranks
    (a barrier), then rank 0 runs `scontrol requeue $SLURM_JOB_ID` and tells the others the outcome.
    The job must be requeueable (sbatch --requeue, see launch/slurm.py). A failing or missing
    `scontrol` is a warning, not an error: the checkpoint is safe and the job can be resubmitted.
    """
    job_id = os.environ.get("SLURM_JOB_ID")
    if not enabled or not job_id:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        return _requeue(job_id)
    dist.barrier()
    outcome = torch.tensor([int(dist.get_rank() == 0 and _requeue(job_id))], dtype=torch.int32,
                           device=_collective_device())
    dist.broadcast(outcome, src=0)
    return bool(outcome.item())


def _requeue(job_id: str) -> bool:
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        log.warning("scontrol is not on PATH: SLURM job %s was not requeued; resubmit it", job_id)
        return False
    command = [scontrol, "requeue", job_id]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("`%s` failed (%s): job not requeued; resubmit it", " ".join(command), err)
        return False
    if result.returncode != 0:
        log.warning("`%s` exited with %d: %s; job not requeued, resubmit it", " ".join(command),
                    result.returncode, (result.stderr or result.stdout).strip() or "no output")
        return False
    log.info("requeued SLURM job %s (`%s`)", job_id, " ".join(command))
    return True
