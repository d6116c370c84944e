"""Small token datasets written for the data tests: documents of chosen lengths whose token ids
count up, so every sample can be checked against the stream it came from."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_tools.writer import IndexedDatasetWriter

EOS = 2


def write_dataset(prefix: Path, lengths: list[int], first_id: int = 10,
                  vocab_size: int = 1000) -> Path:
    """Documents of the given lengths (EOS last), ids counting up from ``first_id`` (mod vocab)."""
    docs = []
    next_id = first_id
    for length in lengths:
        body = [(next_id + i) % (vocab_size - 10) + 10 for i in range(length - 1)]
        next_id += length - 1
        docs.append(body + [EOS])
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(np.array(sum(docs, []), dtype=np.uint16), np.array(lengths))
        writer.commit({"tokenizer": {"sha256": "abc", "vocab_size": vocab_size, "eos_id": EOS,
                                     "pad_id": 0, "bos_id": 1, "unk_id": 3},
                       "append_eos": True})
    return prefix
