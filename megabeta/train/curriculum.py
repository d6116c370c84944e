"""`train.block_size_schedule`: a block-size curriculum for beta_1.2 (spec §3's c).

A schedule is a list of `[step, block_size]` pairs, steps increasing from 0: from optimizer step
`step` on (0-based: the steps done before it), the training forward computes beta_1.2 at that
block size; the last pair's block size is `model.block_size`, so the model trained last, saved
in every checkpoint and evaluated, is the spec's function at the model's c. `[[0, 256], [300,
32]]` trains 300 steps at c = 256 (= T for 256-token samples: the standard Transformer's
function, spec §4.1) and the rest at c = 32. The parameters do not depend on c (spec §1), so
one model serves every stage.

Only the training step's forward and backward see a stage's c (`training_block_size`): the
evaluation, the dials, checkpoints and the final model see the model's own. The stage is a pure
function of the step, so a resumed run continues in the stage it stopped in. A change of c is a
change of the model's config for the call: the pass plans its waves from it and the executor keys
its compiled graphs and CUDA graphs by it (model/beta12.py), so nothing inside the forward reads
a flag.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn


def block_size_at(schedule: list[list[int]], step: int) -> int | None:
    """The block size of the stage that optimizer step `step` (0-based) trains in; None without
    a schedule (the model's own)."""
    current = None
    for start, block_size in schedule:
        if start > step:
            break
        current = block_size
    return current


@contextlib.contextmanager
def training_block_size(model: nn.Module, block_size: int | None) -> Iterator[None]:
    """`model` computing at `block_size` for the duration (None: as it is); its own config back
    afterwards."""
    own = model.config
    if block_size is None or block_size == own.block_size:
        yield
        return
    model.config = own.replace(block_size=block_size)
    try:
        yield
    finally:
        model.config = own


__all__ = ["block_size_at", "training_block_size"]
