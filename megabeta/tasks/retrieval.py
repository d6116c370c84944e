"""Associative retrieval: the values of variables assigned earlier in a document, the one-step
relative of `chains` that asks for nothing but a read of an earlier position.

A document assigns `pairs` distinct variables one digit each, one statement a line, then asks
for `queries` of them (distinct, in random order): `?name=` followed by the scored digit. Three
pairs, two queries:

    qd=7
    ab=3
    xe=7
    ?ab=3
    ?qd=7

Names are two lowercase letters (`chains.NAMES`), all distinct within a document; values are the
digits 0 … values-1, uniform and independent. Chance is 1/values: an answer is uniform whatever
the rest of the document says. A model must find the queried name's assignment, anywhere in the
document, and copy the digit after it: with a small vocabulary (most of a statement's symbols one
token each) the assignments span many blocks of beta_1.2, which reads them only through the
finished outputs of its layers (spec §3).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megabeta.tasks.chains import NAMES, check_values
from megabeta.tasks.document import DocumentBuilder, TaskDocument


@dataclass(frozen=True)
class Retrieval:
    """Options of the retrieval task; ValueError naming the flag when one is out of range."""

    pairs: int = 16
    queries: int = 4
    values: int = 10

    def __post_init__(self) -> None:
        if not 1 <= self.pairs <= len(NAMES):
            raise ValueError(f"--pairs {self.pairs}: must be in 1 … {len(NAMES)} (the "
                             "two-letter names)")
        if not 1 <= self.queries <= self.pairs:
            raise ValueError(f"--queries {self.queries}: must be in 1 … --pairs {self.pairs} "
                             "(each query asks for another variable)")
        check_values(self.values)

    @property
    def name(self) -> str:
        return f"retrieval-p{self.pairs}-q{self.queries}-v{self.values}"

    @property
    def chance(self) -> float:
        return 1.0 / self.values

    def generate(self, rng: np.random.Generator) -> TaskDocument:
        names = [NAMES[i] for i in rng.choice(len(NAMES), size=self.pairs, replace=False)]
        values = rng.integers(self.values, size=self.pairs)
        doc = DocumentBuilder()
        for name, value in zip(names, values):
            doc.text(f"{name}={value}\n")
        for index in rng.choice(self.pairs, size=self.queries, replace=False):
            doc.text(f"?{names[index]}=")
            doc.answer(str(values[index]))
            doc.text("\n")
        return doc.build(self.name, self.chance)
