"""Stragglers and hangs on 2 CPU ranks (gloo): rank 1's data loading is slowed, then stalled;
the straggler report and the hang watchdog must name rank 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megabeta.train.watchdog import Watchdog, enable_flight_recorder, name_laggards
from support.train_helpers import TINY_CONFIG, TINY_OVERRIDES
from support.dist_helpers import launcher_free_environ
from support import REPO, SCRIPTS


def test_name_laggards() -> None:
    said = name_laggards({0: (4, "forward_backward"), 1: (4, "data"), 2: (4, "forward_backward")},
                         4)
    assert said.startswith("rank(s) [1] are behind, in data of step 4; rank(s) [0, 2] wait in "
                           "forward_backward")
    assert "rank(s) [3] did not answer" in said
    assert "every answering rank is in optimizer" in name_laggards({0: (2, "optimizer")}, 1)


def test_slow_and_stalled_rank_is_named(tiny_data, tmp_path: Path) -> None:
    prefix, _ = tiny_data
    run_dir = tmp_path / "run"
    args = [str(TINY_CONFIG), *TINY_OVERRIDES, f"--data.path={prefix}", f"--run_dir={run_dir}", "--train.steps=4",
            "--logging.interval=3", "--monitor.hang_seconds=2", "--monitor.straggler_ratio=1.5",
            "--monitor.beta_dials=false", "--parallel.backend=ddp", "--checkpoint.interval=0",
            "--checkpoint.save_at_end=false", "--eval.batches=1"]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPTS / "stall_rank.py"), *args],
        capture_output=True, text=True, timeout=240, env=launcher_free_environ(), cwd=REPO)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    # Steps 1-3: rank 1 waits 0.15 s per batch for its data, rank 0 not at all.
    assert "straggler: rank 1 data wait" in output, output[-4000:]
    # Step 4: rank 1 sleeps 6 s in its data loading; both watchdogs fire after 2 s.
    assert "hang at step 4: rank(s) [1] are behind, in data of step 4; rank(s) [0] wait in " \
           "forward_backward" in output, output[-4000:]
    for rank in (0, 1):
        stacks = (run_dir / "hang" / f"rank{rank}_step4.txt").read_text()
        assert "Thread" in stacks and "megabeta/train/watchdog.py" in stacks
    # The stalled rank's main thread was caught in its sleep.
    assert "stall_rank.py" in (run_dir / "hang" / "rank1_step4.txt").read_text()


def test_nccl_flight_recorder_is_turned_on_and_dumped(tmp_path: Path, monkeypatch) -> None:
    """The NCCL-only steps, with NCCL stood in for (the CPU build has none): the recorder's
    buffer set before the process group unless the user set one, and a hang report writes the
    recorder's dump beside the stacks."""
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    enable_flight_recorder()
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "64")
    enable_flight_recorder()
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "64"
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_nccl_trace",
                        lambda: b"last collectives", raising=False)
    watchdog = Watchdog(3600, tmp_path, rank=0, world_size=1)
    try:
        watchdog.report(5, "optimizer", 4000.0)
    finally:
        watchdog.close()
    hang = tmp_path / "hang"
    assert (hang / "nccl_trace_rank0.pkl").read_bytes() == b"last collectives"
    assert "Thread" in (hang / "rank0_step5.txt").read_text()
