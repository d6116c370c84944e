"""The profiler: `profile.steps` parsing, per-rank traces of the chosen steps with rank 0's table
of top operators; CUDA memory snapshots (the allocator calls stood in for) and the
out-of-memory stop; nothing built or written when the diagnostics are off."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from megabeta.config import ProfileConfig, load_config
from megabeta.model import ConfigError
from megabeta.train.diagnostics import Diagnostics
from megabeta.train.loop import Trainer, TrainingStopped
from megabeta.train.profiling import StepProfiler, StepSelection, parse_steps
from support.train_helpers import TINY, TINY_CONFIG, TINY_OVERRIDES, launch


def test_parse_steps() -> None:
    assert parse_steps("") is None
    assert parse_steps("100-102") == StepSelection(first=100, last=102)
    assert parse_steps("7") == StepSelection(first=7, last=7)
    every = parse_steps("every:50")
    assert [s for s in range(1, 160) if every.starts(s)] == [50, 100, 150]
    ranged = parse_steps("3-4")
    assert [s for s in range(1, 9) if ranged.starts(s)] == [3]
    assert [s for s in range(3, 9) if ranged.ends(s)] == [4]
    for bad in ("0-2", "4-3", "every:", "every:-1", "3-", "x"):
        with pytest.raises(ConfigError, match="profile.steps"):
            parse_steps(bad)


def test_profiled_steps_write_a_trace_and_rank0_prints_top_ops(tiny_data, tmp_path) -> None:
    prefix, _ = tiny_data
    run_dir = tmp_path / "run"
    done = launch([*TINY, f"--data.path={prefix}", f"--run_dir={run_dir}", "--train.steps=3",
                   "--profile.steps=2-3", "--profile.top_ops=5", "--monitor.beta_dials=false",
                   "--checkpoint.interval=0", "--checkpoint.save_at_end=false",
                   "--eval.batches=1"])
    folder = run_dir / "profile" / "step_2"
    trace = json.loads((folder / "rank0.pt.trace.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert "aten::mm" in names  # the step's matmuls, on the host
    # Steps 2 and 3, no more: one optimizer update each.
    updates = [e for e in trace["traceEvents"] if e.get("name", "").startswith("Optimizer.step")]
    assert len(updates) == 2
    table = (folder / "top_ops.txt").read_text()
    assert "Self CPU" in table and "Self CPU time total" in table
    assert "profiled steps 2-3" in done.stdout + done.stderr
    # Header, then top_ops = 5 operator rows, between dashed rules.
    lines = table.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("---")]
    assert len(rules) == 3 and rules[2] - rules[1] - 1 == 5, table


def test_memory_snapshots_record_from_the_start_and_dump_on_out_of_memory(tmp_path,
                                                                          monkeypatch) -> None:
    """The CUDA-only allocator calls, stood in for (no GPU here): history recorded from the
    start, bounded; an out-of-memory error dumps a snapshot and names it; closing stops the
    recording. On another device the switch warns and the message says how to get one."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot",
                        lambda path: Path(path).write_bytes(b"snapshot"))
    config = ProfileConfig(memory_snapshot=True)
    profiler = StepProfiler(config, tmp_path, 3, torch.device("cuda"))
    assert calls == [{"max_entries": 100_000}]
    message = profiler.out_of_memory(7)
    snapshot = tmp_path / "profile" / "oom_rank3_step7.pickle"
    assert snapshot.read_bytes() == b"snapshot"
    assert message == f"allocator snapshot in {snapshot} (open it at https://pytorch.org/memory_viz)"
    profiler.close()
    assert calls[-1] == {"enabled": None}
    on_cpu = StepProfiler(config, tmp_path / "cpu", 0, torch.device("cpu"))
    assert len(calls) == 2 and "profile.memory_snapshot = true" in on_cpu.out_of_memory(1)
    assert not (tmp_path / "cpu").exists()


def test_out_of_memory_stops_the_run_with_a_message(tiny_data, tmp_path,
                                                    one_torch_thread) -> None:
    prefix, _ = tiny_data
    trainer = Trainer(load_config(TINY_CONFIG, [*TINY_OVERRIDES, f"--data.path={prefix}",
                                                f"--run_dir={tmp_path}", "--train.steps=3",
                                                "--monitor.beta_dials=false"]))

    def forward_backward(*args, **kwargs):
        if trainer.state.step + 1 == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return clean(*args, **kwargs)

    clean, trainer.engine.forward_backward = trainer.engine.forward_backward, forward_backward
    with pytest.raises(TrainingStopped, match=r"^out of memory at step 2 on rank 0: set "
                                              r"profile\.memory_snapshot = true"):
        trainer.train()


def test_diagnostics_that_are_off_build_nothing(tmp_path, monkeypatch) -> None:
    """profile.steps empty, hang_seconds 0, no spike window, no dials: no profiler is ever
    made, no watchdog thread started, and the gate accepts without judging."""
    def no_profiler(*args, **kwargs):
        raise AssertionError("a profiler was built with profile.steps empty")

    monkeypatch.setattr(torch.profiler, "profile", no_profiler)
    config = load_config(None, ["--monitor.spike_window=0", "--monitor.beta_dials=false",
                                f"--run_dir={tmp_path}"])
    model = torch.nn.Linear(2, 2)
    threads = threading.active_count()
    diagnostics = Diagnostics(config, tmp_path, rank=0, world_size=1,
                              device=torch.device("cpu"), model=model, optimizer=None)
    assert diagnostics.watchdog is None and threading.active_count() == threads
    for step in (1, 2, 3):
        diagnostics.begin(step)
        model(torch.ones(1, 2)).sum().backward()
        assert diagnostics.gate(step, loss=1e30)(1e30) is True
        diagnostics.end(step, 0.0, 0.1)
        assert diagnostics.spike() is None
    diagnostics.close()
    assert not (tmp_path / "profile").exists() and not (tmp_path / "hang").exists()
