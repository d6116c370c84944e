"""Variable-carrying chains, after the article's serial testbed (its "variable-carrying channel",
with beta_1 figures for n = 8 and n = 32 hops; the article does not give its format, this one is
ours).

A document holds `chains` chains of `hops` hops each. A chain is a variable assigned a constant
followed by `hops` copies, each into a fresh variable: `ab=7`, then `qd=ab`, `xe=qd`, ... The
statements of all chains are interleaved uniformly at random, each chain's in order (a copy
always comes after the statement it copies), so every chain is the others' distractors. Then
every chain's end is queried, in random order: `?xe=` followed by the scored answer `7`. Two
chains of two hops:

    ab=7
    kf=3
    qd=ab
    mm=kf
    xe=qd
    zu=mm
    ?zu=3
    ?xe=7

Names are two lowercase letters, all distinct within a document and each assigned once, so the
value of a name is well defined; constants are the digits 0 … values-1, drawn uniformly and
independently. An answer is one digit, one token (the tokenizer splits digits), and each line
ends in a newline, so the answer is never glued to surrounding text.

Chance is 1/values: every answer is uniform over the digits whatever else the document says,
so a predictor that ignores the document is right that often. A model that has learnt that the
answer is one of the document's constants but not which chain leads to the query does better:
picking one of the `chains` constants at random scores 1/chains + (1 - 1/chains)/values
(0.55 for 2 chains of 10 values, 0.325 for 4); more chains lower that shortcut.
"""

from __future__ import annotations

from dataclasses import dataclass
from string import ascii_lowercase

import numpy as np

from megabeta.tasks.document import DocumentBuilder, TaskDocument

NAMES = tuple(a + b for a in ascii_lowercase for b in ascii_lowercase)
"""Variable names: two lowercase letters (676)."""


def check_values(values: int) -> None:
    """ValueError naming --values unless the constants 0 … values-1 are single digits."""
    if not 2 <= values <= 10:
        raise ValueError(f"--values {values}: must be in 2 … 10 (the constants are single "
                         "digits)")


@dataclass(frozen=True)
class Chains:
    """Options of the chains task; ValueError naming the flag when one is out of range."""

    hops: int = 8
    chains: int = 2
    values: int = 10

    def __post_init__(self) -> None:
        if self.hops < 1:
            raise ValueError(f"--hops {self.hops}: must be >= 1 (copies per chain)")
        if self.chains < 1:
            raise ValueError(f"--chains {self.chains}: must be >= 1")
        check_values(self.values)
        if self.chains * (self.hops + 1) > len(NAMES):
            raise ValueError(f"--chains {self.chains} x (--hops {self.hops} + 1) = "
                             f"{self.chains * (self.hops + 1)} variables, more than the "
                             f"{len(NAMES)} two-letter names; lower --chains or --hops")

    @property
    def name(self) -> str:
        return f"chains-n{self.hops}-k{self.chains}-v{self.values}"

    @property
    def chance(self) -> float:
        return 1.0 / self.values

    def generate(self, rng: np.random.Generator) -> TaskDocument:
        length = self.hops + 1  # variables per chain: the constant's and one per hop
        names = [NAMES[i] for i in rng.choice(len(NAMES), size=self.chains * length,
                                              replace=False)]
        constants = rng.integers(self.values, size=self.chains)
        # A uniformly random interleaving that keeps each chain in order: shuffle the multiset
        # of chain labels, then emit each label's next statement.
        order = rng.permutation(np.repeat(np.arange(self.chains), length))
        doc = DocumentBuilder()
        done = [0] * self.chains
        for chain in order:
            step = done[chain]
            target = names[chain * length + step]
            source = str(constants[chain]) if step == 0 else names[chain * length + step - 1]
            doc.text(f"{target}={source}\n")
            done[chain] += 1
        for chain in rng.permutation(self.chains):
            doc.text(f"?{names[chain * length + self.hops]}=")
            doc.answer(str(constants[chain]))
            doc.text("\n")
        return doc.build(self.name, self.chance)
