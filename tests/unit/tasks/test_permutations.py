"""Permutations (megabeta/tasks/permutations.py): each answer is the prefix product of S5 or A5.

The generator is right: an independent solver here (parsing the text back and simulating it,
written apart from the generator) checks every answer of a few hundred documents of every variant.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from support.tasks_helpers import prompts, records

from megabeta.tasks.permutations import Permutations


def matrix(one_line: str) -> np.ndarray:
    """The permutation matrix of a one-line notation: column x holds e_{w(x)}."""
    m = np.zeros((5, 5), dtype=np.int64)
    for x, image in enumerate(one_line):
        m[int(image) - 1, x] = 1
    return m


def from_matrix(m: np.ndarray) -> str:
    return "".join(str(int(np.argmax(m[:, x])) + 1) for x in range(5))


def solve_permutations(prompt_lines: list[str]) -> tuple[list[str], list[int]]:
    """Prefix products as products of permutation matrices (g_i applied after p_(i-1)); and the
    sign (determinant) of each element read."""
    product = np.eye(5, dtype=np.int64)
    answers, signs = [], []
    for line in prompt_lines:
        element = re.fullmatch(r"([1-5]{5})>", line).group(1)
        assert sorted(element) == list("12345"), element
        product = matrix(element) @ product
        answers.append(from_matrix(product))
        signs.append(round(np.linalg.det(matrix(element))))
    return answers, signs


@pytest.mark.parametrize("name", ["S5", "A5"])
def test_permutation_answers_match_the_solver(files, name):
    length = 12 if name == "A5" else Permutations().length
    signs = set()
    for record in records(files[name]):
        assert record["task"] == f"permutations-{name}-L{length}"
        lines, scored = prompts(record)
        answers, element_signs = solve_permutations(lines)
        assert answers == scored and len(answers) == length
        signs |= set(element_signs)
    assert signs == ({1} if name == "A5" else {-1, 1})
