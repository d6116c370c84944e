"""The profiler: `profile.steps` parsing, per-rank traces of the chosen steps with rank 0's table
of top operators (nothing is written when it is off: tests/test_train_monitor.py)."""

from __future__ import annotations

import json

import pytest

from megabeta.model import ConfigError
from megabeta.train.profiling import StepSelection, parse_steps
from support.train_helpers import TINY, launch


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
