"""The hang watchdog in one process (megabeta/train/watchdog.py): a step that runs past
`monitor.hang_seconds` is reported once, naming its phase's work (a single process has no
collective to blame) and the stack file by its path; the stacks go to stderr once per launch;
a reported step that then finishes was slow, not hung: said, after which the watchdog waits
twice that step's time, so a limit below the step time does not fire on every step. The
multi-rank report (rank 1 stalled, rank 0 named as waiting) is tests/integration/
test_train_watchdog.py."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from megabeta.train.watchdog import Watchdog


def run_steps(watchdog: Watchdog, seconds: list[float]) -> None:
    """Steps 1, 2, ... of the given lengths, each in forward_backward after a moment of data."""
    for step, length in enumerate(seconds, 1):
        watchdog.enter(step, "data")
        watchdog.enter(step, "forward_backward")
        time.sleep(length)
    watchdog.enter(len(seconds) + 1, "data")
    time.sleep(0.2)  # the watchdog's thread sees the last step end


def test_a_single_process_is_reported_without_collectives_and_not_on_every_step(
        tmp_path: Path, caplog, capfd) -> None:
    caplog.set_level(logging.WARNING, logger="megabeta")
    watchdog = Watchdog(0.3, tmp_path, rank=0, world_size=1)
    try:
        # Step 1 is not watched; 2 overruns and finishes; 3 as long is within twice 2's time;
        # 4 overruns that.
        run_steps(watchdog, [0.9, 0.9, 0.9, 2.6])
    finally:
        watchdog.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [e.split(" has run")[0] for e in errors] == ["step 2", "step 4"], errors
    hang = tmp_path / "hang"
    assert f"in forward_backward: the forward and backward passes; a single process waits for " \
           f"no other rank" in errors[0]
    assert f"Every thread's stack below and in {hang / 'rank0_step2.txt'}." in errors[0]
    assert f"Every thread's stack in {hang / 'rank0_step4.txt'}." in errors[1]
    assert "(monitor.hang_seconds = 0.3)" in errors[0] and "twice the slowest step" in errors[1]
    for said in errors:
        assert "reduction" not in said and "all_reduce" not in said and "<R>" not in said
    assert not any(r.getMessage().startswith("hang at step") for r in caplog.records)
    assert [w.split(" s: ")[0] for w in warnings] == ["step 2 finished after 0.9",
                                                      "step 4 finished after 2.6"], warnings
    assert "slow, not hung" in warnings[0] and "reports a step only after 1.8 s" in warnings[0]
    # The stacks: in a file per report, on stderr once.
    assert "Thread" in (hang / "rank0_step2.txt").read_text()
    assert "Thread" in (hang / "rank0_step4.txt").read_text()
    assert capfd.readouterr().err.count("most recent call first") == \
        (hang / "rank0_step2.txt").read_text().count("most recent call first")
    assert not list(hang.glob("position_*"))  # no other rank to compare positions with
