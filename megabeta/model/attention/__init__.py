"""beta_1.2's attention (spec §3): the interface (`backend.py`), its implementations
(`reference.py`, `cpu.py`, `triton_backend.py`) and the choice among them (`select.py`)."""

from megabeta.model.attention.backend import (
    NO_BIASES,
    AttentionBackend,
    Biases,
    BiasRows,
    Capabilities,
    KeyLayout,
    Reads,
)
from megabeta.model.attention.select import select_attention

__all__ = ["AttentionBackend", "Biases", "BiasRows", "Capabilities", "KeyLayout", "NO_BIASES",
           "Reads", "select_attention"]
