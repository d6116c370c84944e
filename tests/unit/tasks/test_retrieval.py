"""Retrieval (megabeta/tasks/retrieval.py): every query is a value assigned once, earlier.

Checked with the chains' independent solver (tests/support/tasks_helpers.py): it parses the
text back and runs it, so a query's answer is whatever the program assigned, read, not followed.
"""

from __future__ import annotations

import re

import pytest
from support.tasks_helpers import prompts, records, solve_chains

from megabeta.tasks.retrieval import Retrieval


@pytest.mark.parametrize("name", ["retrieval", "retrieval-p40-q6-v5"])
def test_retrieval_answers_match_the_solver(files, name):
    options = Retrieval() if name == "retrieval" else Retrieval(pairs=40, queries=6, values=5)
    seen_values = set()
    for record in records(files[name]):
        assert record["task"] == options.name and record["chance"] == 1 / options.values
        lines, scored = prompts(record)
        answers, program = solve_chains(lines)
        assert answers == scored and len(answers) == options.queries
        assert program["depths"] == [0] * options.queries  # read, not followed
        assert program["constants"] == options.pairs
        queried = re.findall(r"\?([a-z]{2})=", record["text"])
        assert len(set(queried)) == options.queries
        seen_values |= program["values"]
    assert seen_values == set(range(options.values))
