"""beta_1.2's attention (spec §3): the key-set interface (`backend.py`), its implementations
(`explicit.py`, `merged.py`, `triton_backend.py`) and the choice among them (`select.py`)."""

from megabeta.model.attention.backend import (
    NO_BIAS,
    AttentionBackend,
    AttentionBias,
    BiasRows,
    DocumentBounds,
    GroupBatch,
    KeyLayout,
    KeySet,
    PassDocuments,
    StoredHistory,
    WaveBias,
)
from megabeta.model.attention.select import select_attention

__all__ = ["AttentionBackend", "AttentionBias", "BiasRows", "DocumentBounds", "NO_BIAS", "GroupBatch", "KeyLayout",
           "KeySet", "PassDocuments", "StoredHistory", "WaveBias", "select_attention"]
