"""Exact-match scoring of tokenized task documents against a next-token predictor.

Pure: documents are (tokens, mask) pairs as `data_tools.encode.encode_segments` gives them, and
the model is any `predict(tokens [B, T]) -> ids [B, T]` whose output at position t is its guess
of token t + 1 (a language model's greedy argmax, teacher-forced). An answer is a maximal run of
scored tokens (mask 1); it is correct when the prediction is right at every one of its tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

Predictor = Callable[[torch.Tensor], torch.Tensor]
"""Long tokens `[B, T]` -> predicted ids `[B, T]`; output t is the prediction of token t + 1."""


@dataclass(frozen=True)
class EncodedDocument:
    """A tokenized task document: its task, token ids, loss mask (1 = scored target) and the
    task's chance level (None when unknown)."""

    task: str
    tokens: np.ndarray
    mask: np.ndarray
    chance: float | None = None

    @property
    def input_length(self) -> int:
        """Tokens the predictor must read: those before the last scored token (0: none scored)."""
        scored = np.flatnonzero(self.mask)
        return int(scored[-1]) if len(scored) else 0


@dataclass
class TaskScore:
    """Exact-match results of one task."""

    task: str
    chance: float | None
    documents: int = 0
    answers: int = 0
    correct: int = 0

    @property
    def accuracy(self) -> float:
        """Share of answers right at every token; NaN when there are no answers."""
        return self.correct / self.answers if self.answers else math.nan

    def as_dict(self) -> dict:
        return {"task": self.task, "documents": self.documents, "answers": self.answers,
                "correct": self.correct,
                "accuracy": None if math.isnan(self.accuracy) else self.accuracy,
                "chance": self.chance}


def answer_spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """The maximal runs of ones in `mask`, as [start, end) token ranges."""
    edges = np.diff(np.concatenate([[0], (np.asarray(mask) != 0).astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def score_documents(documents: Iterable[EncodedDocument], predict: Predictor,
                    batch_size: int = 8, pad_id: int = 0) -> dict[str, TaskScore]:
    """Exact-match scores per task (in order of first appearance) of `predict` on `documents`,
    `batch_size` documents per call, right-padded with `pad_id` (a causal predictor's outputs
    before the padding do not depend on it). ValueError for a document whose first token is
    scored: nothing precedes it to predict it from."""
    documents = list(documents)
    scores: dict[str, TaskScore] = {}
    for document in documents:
        score = scores.setdefault(document.task, TaskScore(document.task, document.chance))
        score.documents += 1
        if document.chance != score.chance:
            # Two variants under one name would mix their chance levels in one row.
            raise ValueError(f"task {document.task!r}: documents with chance {score.chance} "
                             f"and {document.chance}; one task name must be one variant")
        if len(document.mask) and document.mask[0]:
            raise ValueError(f"a {document.task!r} document scores its first token, which has "
                             "no context to be predicted from; start it with unscored text")
    # Similar lengths batched together: less padding, the same results in any order.
    order = sorted((i for i, d in enumerate(documents) if d.input_length),
                   key=lambda i: documents[i].input_length)
    for start in range(0, len(order), batch_size):
        batch = [documents[i] for i in order[start:start + batch_size]]
        width = max(d.input_length for d in batch)
        inputs = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for row, document in enumerate(batch):
            inputs[row, :document.input_length] = torch.from_numpy(
                document.tokens[:document.input_length].astype(np.int64))
        predicted = predict(inputs).cpu().numpy()
        if predicted.shape != inputs.shape:
            raise ValueError(f"predict returned shape {tuple(predicted.shape)} for inputs "
                             f"{tuple(inputs.shape)}; it must return one id per input token")
        for row, document in enumerate(batch):
            score = scores[document.task]
            for begin, end in answer_spans(document.mask):
                score.answers += 1
                # Token i is predicted at position i - 1.
                score.correct += bool(np.array_equal(predicted[row, begin - 1:end - 1],
                                                     document.tokens[begin:end]))
    return scores
