"""Counting what torch.compile compiled in a test, with dynamo's own reasons for any recompile
in the failure message (a count alone says nothing about which guard failed)."""

from __future__ import annotations

import torch._dynamo
import torch._dynamo.utils


def fresh_dynamo() -> None:
    """Forget every compiled frame, guard failure and counter."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def graphs_compiled() -> int:
    """Graphs dynamo compiled since `fresh_dynamo`."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def assert_graphs(expected: int) -> None:
    """Exactly `expected` graphs compiled; otherwise the failed guards that caused recompiles."""
    got = graphs_compiled()
    reasons = [f"{code.co_name} ({code.co_filename}:{code.co_firstlineno}): {reason}"
               for code, failures in torch._dynamo.utils.guard_failures.items()
               for reason in failures]
    assert got == expected, (f"{got} graphs compiled, expected {expected}; recompiled for: "
                             + ("; ".join(reasons) or "no guard failure (a graph break?)"))
