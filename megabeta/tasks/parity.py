"""Parity of a bit string: the cheap sanity check of the pipeline (generate, tokenize, train,
evaluate) before the serial tasks.

A document is `length` uniformly random bits, `=`, and the scored parity (1 when the number of
ones is odd), one line:

    0110100=1

Bits and the answer are digits, one token each (the tokenizer splits digits). Chance is 1/2: the
parity of uniform bits is uniform.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megabeta.tasks.document import DocumentBuilder, TaskDocument


@dataclass(frozen=True)
class Parity:
    """Options of the parity task; ValueError naming the flag when one is out of range."""

    length: int = 16

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"--length {self.length}: must be >= 1 (bits per document)")

    @property
    def name(self) -> str:
        return f"parity-L{self.length}"

    @property
    def chance(self) -> float:
        return 0.5

    def generate(self, rng: np.random.Generator) -> TaskDocument:
        bits = rng.integers(2, size=self.length)
        doc = DocumentBuilder()
        doc.text("".join(map(str, bits)) + "=")
        doc.answer(str(int(bits.sum()) % 2))
        doc.text("\n")
        return doc.build(self.name, self.chance)
