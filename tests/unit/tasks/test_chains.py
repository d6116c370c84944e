"""Chains (megabeta/tasks/chains.py): every query is the value n copies away.

The generator is right: an independent solver here (parsing the text back and simulating it,
written apart from the generator) checks every answer of a few hundred documents of every variant.
"""

from __future__ import annotations

import re

import pytest
from support.tasks_helpers import prompts, records

from megabeta.tasks.chains import Chains


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


@pytest.mark.parametrize("name", ["chains-n8", "chains-n32", "chains-n3-k5-v4"])
def test_chains_answers_match_the_solver(files, name):
    options = {"chains-n8": Chains(hops=8), "chains-n32": Chains(hops=32),
               "chains-n3-k5-v4": Chains(hops=3, chains=5, values=4)}[name]
    seen_values = set()
    for record in records(files[name]):
        assert record["task"] == options.name and record["chance"] == 1 / options.values
        lines, scored = prompts(record)
        answers, program = solve_chains(lines)
        assert answers == scored
        assert program["depths"] == [options.hops] * options.chains  # every query n hops away
        assert len(program["ends"]) == options.chains == program["constants"]
        assert set(re.findall(r"\?([a-z]{2})=", record["text"])) == program["ends"]
        seen_values |= program["values"]
    assert seen_values == set(range(options.values))
