"""Preemption: stop signals end the run at a step boundary, the same one on every rank; requeue."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.dist_helpers import REPORT, launcher_free_environ, read_reports

from megabeta.train.signals import STOP_SIGNALS, PreemptionHandler, maybe_requeue


def test_signal_is_recorded_and_handlers_restored() -> None:
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with PreemptionHandler() as preempt:
        assert all(signal.getsignal(sig) == preempt._on_signal for sig in STOP_SIGNALS)
        assert not preempt.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # the first signal is the one reported
        assert preempt.received == signal.SIGUSR1
        assert preempt.should_stop() and preempt.should_stop()
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_close_keeps_a_handler_installed_after_ours() -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    preempt = PreemptionHandler()
    mine = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGUSR1, mine)
    try:
        preempt.close()
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_second_ctrl_c_while_stopping_interrupts(first: signal.Signals) -> None:
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with PreemptionHandler() as preempt:
            os.kill(os.getpid(), first)
            assert preempt.stopping and preempt.received == first
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the interrupt ends this sleep at once
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, saved)


def test_refuses_to_start_outside_the_main_thread() -> None:
    errors: list[BaseException] = []

    def create() -> None:
        try:
            PreemptionHandler()
        except RuntimeError as err:
            errors.append(err)

    thread = threading.Thread(target=create)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


STEP_LOOP = """
import json, sys, time
from megabeta.train.signals import PreemptionHandler
with PreemptionHandler() as preempt:
    for step in range(int(sys.argv[1])):
        print(f"begin {step}", flush=True)
        time.sleep(0.2)
        print(f"end {step}", flush=True)
        if preempt.should_stop():
            print("STOPPED " + json.dumps({"step": step, "signal": preempt.received.name}),
                  flush=True)
            break
"""


def test_sigterm_finishes_the_current_step_and_exits_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(STEP_LOOP)
    steps = 100
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen([sys.executable, str(script), str(steps)], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=launcher_free_environ())
        watchdog = threading.Timer(60, proc.kill)  # a run ignoring SIGTERM must not hang tests
        watchdog.start()
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line.strip())
                if lines[-1] == "begin 2":
                    proc.send_signal(signal.SIGTERM)
        finally:
            watchdog.cancel()
        assert proc.wait() == 0, err.seek(0) or err.read()
    stopped = json.loads(lines[-1].removeprefix("STOPPED "))
    step = stopped["step"]
    assert stopped["signal"] == "SIGTERM" and 2 <= step < steps - 1
    # The step running when the signal came ran to its end, and no further step began.
    assert lines[-3:-1] == [f"begin {step}", f"end {step}"], lines


@pytest.fixture
def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Put an `scontrol` first on PATH that records its arguments and exits with the given code."""
    def install(exit_code: int = 0, stderr: str = "") -> Path:
        bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
        bin_dir.mkdir(exist_ok=True)
        tool = bin_dir / "scontrol"
        tool.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n'
                        f'echo "{stderr}" >&2\nexit {exit_code}\n')
        tool.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        return calls
    return install


AGREEMENT = REPORT + """
import time
from megabeta.parallel.env import init_distributed, destroy_distributed
from megabeta.train.signals import PreemptionHandler, maybe_requeue
env = init_distributed("gloo", timeout_s=60)
with PreemptionHandler() as preempt:
    for step in range(300):
        time.sleep(0.05)
        if step == 3 and env.rank == 1:
            with open(sys.argv[2] + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(sys.argv[2] + ".tmp", sys.argv[2])
        if preempt.should_stop():
            break
received = preempt.received.name if preempt.received else None
requeued = maybe_requeue(True)
report({"rank": env.rank, "step": step, "received": received, "requeued": requeued})
destroy_distributed()
"""


@pytest.mark.slow
def test_one_rank_signalled_both_stop_at_the_same_step(tmp_path: Path, fake_scontrol) -> None:
    script, pidfile = tmp_path / "agree.py", tmp_path / "signal-me.pid"
    script.write_text(AGREEMENT)
    calls = fake_scontrol()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", str(script), str(tmp_path), str(pidfile)],
                            env=launcher_free_environ(SLURM_JOB_ID="77"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pidfile.exists(), proc.communicate(timeout=30)[0] if proc.poll() is not None else ""
        os.kill(int(pidfile.read_text()), signal.SIGUSR1)  # rank 1 only, not torchrun or rank 0
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    results = read_reports(tmp_path)
    assert [r["rank"] for r in results] == [0, 1], output
    assert [r["received"] for r in results] == [None, "SIGUSR1"], output
    assert results[0]["step"] == results[1]["step"] < 299, output
    # Requeue: rank 0 alone runs scontrol, once, and every rank learns that it worked.
    assert calls.read_text() == "requeue 77\n"
    assert [r["requeued"] for r in results] == [True, True], output


def test_requeue_runs_scontrol_under_slurm(fake_scontrol, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    calls = fake_scontrol()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    caplog.set_level(logging.INFO, logger="megabeta")
    assert maybe_requeue(True)
    assert calls.read_text() == "requeue 4242\n"
    assert "requeued SLURM job 4242" in caplog.text


def test_requeue_does_nothing_when_disabled_or_outside_slurm(
        fake_scontrol, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_scontrol()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert not maybe_requeue(False)
    monkeypatch.delenv("SLURM_JOB_ID")
    assert not maybe_requeue(True)
    assert not calls.exists()


def test_failing_scontrol_is_a_warning(fake_scontrol, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    calls = fake_scontrol(exit_code=1, stderr="Requested operation is presently disabled")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert not maybe_requeue(True)
    assert calls.read_text() == "requeue 4242\n"
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "exited with 1" in record.message and "presently disabled" in record.message


def test_missing_scontrol_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert not maybe_requeue(True)
    assert "scontrol is not on PATH" in caplog.text
