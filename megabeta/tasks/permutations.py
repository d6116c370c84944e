"""Permutation composition: the prefix products of a sequence of S5 (or A5) elements, scored at
every position. State tracking that needs serial depth: composing elements of a non-solvable
group (A5 is the smallest; S5 contains it) is NC1-complete, believed beyond any fixed number of
standard-attention layers as the sequence grows.

A permutation of {1, …, 5} is written in one-line notation, `w(1) w(2) … w(5)` as five digits
(`21345` swaps 1 and 2). A document is `length` lines; line i holds the element g_i, `>`, and the
scored prefix product p_i = g_i ∘ p_(i-1) (apply g_1 first, then g_2, …: p_i(x) = g_i(p_(i-1)(x)),
p_0 the identity):

    21345>21345
    13245>31245
    ...

The elements are drawn uniformly from the group, independently. An answer is five digit tokens
(the tokenizer splits digits) and is right only when all five are (exact match).

Chance is 1/|G| (1/120 for S5, 1/60 for A5): each prefix product is uniform over the group,
because g_i is uniform and independent of p_(i-1), so a predictor that ignores the document, for
instance one that always answers the same element, is right that often.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

import numpy as np

from megabeta.tasks.document import DocumentBuilder, TaskDocument

DEGREE = 5
_ALL = np.array(list(permutations(range(DEGREE))), dtype=np.int64)


def _is_even(perm: np.ndarray) -> bool:
    inversions = sum(int(a > b) for i, a in enumerate(perm) for b in perm[i + 1:])
    return inversions % 2 == 0


GROUPS = {"S5": _ALL, "A5": _ALL[[_is_even(p) for p in _ALL]]}
"""Each group's elements (0-based one-line notation, one per row), in lexicographic order."""


def one_line(perm: np.ndarray) -> str:
    """`perm` (0-based images) in 1-based one-line notation: the identity is "12345"."""
    return "".join(str(int(image) + 1) for image in perm)


@dataclass(frozen=True)
class Permutations:
    """Options of the permutations task; ValueError naming the flag when one is out of range."""

    # 10 elements are 121 tokens: a document fits tiny_cpu's 128-token context.
    group: str = "S5"
    length: int = 10

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"--group {self.group}: must be one of {', '.join(GROUPS)}")
        if self.length < 1:
            raise ValueError(f"--length {self.length}: must be >= 1 (elements per document)")

    @property
    def name(self) -> str:
        return f"permutations-{self.group}-L{self.length}"

    @property
    def chance(self) -> float:
        return 1.0 / len(GROUPS[self.group])

    def generate(self, rng: np.random.Generator) -> TaskDocument:
        elements = GROUPS[self.group]
        product = np.arange(DEGREE)
        doc = DocumentBuilder()
        for index in rng.integers(len(elements), size=self.length):
            element = elements[index]
            product = element[product]  # (g ∘ p)(x) = g(p(x))
            doc.text(f"{one_line(element)}>")
            doc.answer(one_line(product))
            doc.text("\n")
        return doc.build(self.name, self.chance)
