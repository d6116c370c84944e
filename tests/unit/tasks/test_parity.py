"""Parity (megabeta/tasks/parity.py): the answer is the parity of the bits.

The generator is right: an independent solver here (parsing the text back and simulating it,
written apart from the generator) checks every answer of a few hundred documents of every variant.
"""

from __future__ import annotations

import re

import pytest
from support.tasks_helpers import prompts, records

from megabeta.tasks.parity import Parity


def solve_parity(prompt_lines: list[str]) -> list[str]:
    (line,) = prompt_lines
    bits = re.fullmatch(r"([01]+)=", line).group(1)
    return [str(bits.count("1") % 2)]


@pytest.mark.parametrize("name", ["parity", "parity-L5"])
def test_parity_answers_match_the_solver(files, name):
    length = 5 if name == "parity-L5" else Parity().length
    for record in records(files[name]):
        assert record["task"] == f"parity-L{length}" and record["chance"] == 0.5
        lines, scored = prompts(record)
        assert solve_parity(lines) == scored and len(lines[0]) == length + 1
