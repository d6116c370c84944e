"""The synthetic task files the tests of megabeta/tasks make and read: every task and variant,
made through `megabeta tasks make`, and a document's lines and answers read back."""

from __future__ import annotations

import json
import re
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
    "retrieval": ["--task=retrieval"],
    "retrieval-p40-q6-v5": ["--task=retrieval", "--pairs=40", "--queries=6", "--values=5"],
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


def solve_chains(prompt_lines: list[str]) -> tuple[list[str], dict]:
    """Run the program line by line; the value of each query, and what the program was like."""
    value, depth, copied = {}, {}, set()
    answers, query_depths = [], []
    for line in prompt_lines:
        if match := re.fullmatch(r"([a-z]{2})=(\d|[a-z]{2})", line):
            name, source = match.groups()
            assert name not in value, f"{name} assigned twice"
            if source.isdigit():
                value[name], depth[name] = source, 0
            else:
                assert source in value, f"{source} copied before it is assigned"
                value[name], depth[name] = value[source], depth[source] + 1
                copied.add(source)
        else:
            name = re.fullmatch(r"\?([a-z]{2})=", line).group(1)
            answers.append(value[name])
            query_depths.append(depth[name])
    ends = set(value) - copied
    constants = sum(d == 0 for d in depth.values())
    return answers, {"depths": query_depths, "ends": ends, "constants": constants,
                     "values": {int(v) for v in value.values()}}
