"""The synthetic task files the tests of megabeta/tasks make and read: every task and variant,
made through `megabeta tasks make`, and a document's lines and answers read back."""

from __future__ import annotations

import json
from pathlib import Path

from megabeta.cli import main

VARIANTS = {
    "chains-n8": ["--task=chains", "--hops=8"],
    "chains-n32": ["--task=chains", "--hops=32"],
    "chains-n3-k5-v4": ["--task=chains", "--hops=3", "--chains=5", "--values=4"],
    "S5": ["--task=permutations", "--group=S5"],
    "A5": ["--task=permutations", "--group=A5", "--length=12"],
    "parity": ["--task=parity"],
    "parity-L5": ["--task=parity", "--length=5"],
}
SOLVED = 300
"""Documents of each variant whose every answer the solvers check."""


def make(tmp: Path, name: str, *extra: str, count: int = SOLVED, seed: int = 1) -> Path:
    out = tmp / f"{name}-{count}-{seed}.jsonl"
    assert main(["tasks", "make", *VARIANTS[name], f"--count={count}", f"--seed={seed}",
                 f"--output={out}", *extra]) == 0
    return out


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def prompts(record: dict) -> tuple[list[str], list[str]]:
    """The document's lines with their answers cut out, and the answers (the scored segments),
    after checking that the segments, `text` and `answers` agree."""
    segments = record["segments"]
    assert "".join(s["text"] for s in segments) == record["text"]
    scored = [s["text"] for s in segments if s["loss"]]
    assert scored == record["answers"] and scored
    for before, after in zip(segments, segments[1:]):
        assert not (before["loss"] and after["loss"]), "two answers in a row"
    assert not segments[0]["loss"] and not segments[-1]["loss"]
    text = "".join("" if s["loss"] else s["text"] for s in segments)
    return [line for line in text.split("\n") if line], scored
