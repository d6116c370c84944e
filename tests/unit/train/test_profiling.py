"""The training profiler (megabeta/train/profiling.py): each profiled step is a
`ProfilerStep#<n>` annotation of the trace (the step boundaries `megabeta bench trace` and
TensorBoard read), and kineto's `USDT: ... profiler_start` / `profiler_stop` lines, printed from
C++ to stderr at any log level, do not reach the terminal while other output does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megabeta.config import ProfileConfig
from megabeta.train.profiling import StepProfiler, without_kineto_markers


def test_profiled_steps_are_marked_and_kineto_says_nothing(tmp_path: Path, capfd) -> None:
    profiler = StepProfiler(ProfileConfig(steps="2-3", top_ops=3), tmp_path, 0,
                            torch.device("cpu"))
    layer = torch.nn.Linear(16, 16)
    for step in range(1, 5):
        profiler.begin(step)
        layer(torch.randn(4, 16)).sum().backward()
        profiler.end(step)
    profiler.close()
    events = json.loads((tmp_path / "profile" / "step_2" / "rank0.pt.trace.json").read_text())
    marks = sorted(e["name"] for e in events["traceEvents"]
                   if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#"))
    assert marks == ["ProfilerStep#2", "ProfilerStep#3"]
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_start" not in err, err


def test_other_output_around_the_profiler_still_comes_out(capfd) -> None:
    with without_kineto_markers():
        os.write(2, b"USDT:2026-12-06 17:05:29 8132:8132 SyncActivityProfilerHandler.cpp:52] "
                    b"profiler_start\n")
        os.write(2, b"a warning of another thread\n")
    assert capfd.readouterr().err == "a warning of another thread\n"
