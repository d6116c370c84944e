"""Encoding task documents for evaluation (megabeta/tasks/evaluate.py): the tokenizer's own
tokens and loss mask."""

from __future__ import annotations

import numpy as np

from data_tools.encode import encode_segments
from data_tools.tokenizer import load_tokenizer
from megabeta.tasks.document import read_task_file
from megabeta.tasks.evaluate import encode_documents
from megabeta.tasks.scoring import answer_spans


def test_encoding_is_the_tokenizers(files, tokenizer):
    processor = load_tokenizer(tokenizer)
    document = next(read_task_file(files["chains-n8"]))
    (encoded,) = encode_documents([document], processor)
    tokens, mask = encode_segments(processor, document.segments)
    assert np.array_equal(encoded.tokens, tokens) and np.array_equal(encoded.mask, mask)
    # Answers are one token each, and the model's context holds a default chains-n8 document.
    assert [e - b for b, e in answer_spans(mask)] == [1, 1] and len(tokens) <= 128
