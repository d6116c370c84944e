"""Train/validation split by document ranges: the last documents of a dataset are validation.

Splitting whole documents (never mid-document) keeps a validation document's text out of training;
the split is a pair of contiguous document ranges, hence a pair of contiguous token ranges.
"""

from __future__ import annotations

import math

from megabeta.data.errors import DataError


def split_documents(num_documents: int, val_fraction: float,
                    source: str = "dataset") -> tuple[range, range]:
    """Document ranges ``(train, val)``; ``val`` holds the last ``ceil(val_fraction · D)`` ones.

    ``val_fraction`` 0 gives an empty validation range. ``source`` names the dataset in errors.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction {val_fraction}: must be in [0, 1)")
    num_val = math.ceil(val_fraction * num_documents)
    num_train = num_documents - num_val
    if num_train < 1:
        raise DataError(f"{source}: {num_documents} documents leave none for training at "
                        f"val_fraction {val_fraction}; lower val_fraction or add documents")
    return range(0, num_train), range(num_train, num_documents)
