"""Chains (megabeta/tasks/chains.py): every query is the value n copies away.

The generator is right: an independent solver here (parsing the text back and simulating it,
written apart from the generator) checks every answer of a few hundred documents of every variant.
"""

from __future__ import annotations

import re

import pytest
from support.tasks_helpers import prompts, records, solve_chains

from megabeta.tasks.chains import Chains


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
