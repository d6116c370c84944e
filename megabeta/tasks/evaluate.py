"""Task accuracy of a language model: task files tokenized as training tokenizes them, scored with
the model's greedy teacher-forced predictions (`scoring.score_documents`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from data_tools.encode import encode_segments
from data_tools.tokenizer import Tokenizer
from megabeta.model import DecoderLM
from megabeta.tasks.document import TaskDocument, TaskFileError, read_task_file
from megabeta.tasks.scoring import EncodedDocument, Predictor, TaskScore, score_documents


def encode_documents(documents: Iterable[TaskDocument],
                     processor: Tokenizer) -> list[EncodedDocument]:
    """Tokens and loss masks of `documents` by `encode_segments`, the function that tokenizing
    the training data uses, so the evaluator sees the same token boundaries."""
    encoded = []
    for document in documents:
        tokens, mask = encode_segments(processor, document.segments)
        encoded.append(EncodedDocument(document.task, tokens, mask, document.chance))
    return encoded


def model_predictor(model: DecoderLM, device: torch.device | str = "cpu") -> Predictor:
    """The greedy next-token predictions of `model` (logits' argmax) in the mode it is in; eval
    mode for evaluating (no dropout)."""

    @torch.no_grad()
    def predict(tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens.to(device)).argmax(dim=-1)

    return predict


def read_encoded(task_files: Sequence[str | Path], processor: Tokenizer,
                 max_seq_len: int, max_documents: int = 0,
                 flag: str = "--tasks") -> list[EncodedDocument]:
    """The documents of every file (at most `max_documents` of each; 0 = all), encoded.
    TaskFileError naming the file (as given by `flag`) when it holds none or a document needs
    more context than `max_seq_len`."""
    encoded = []
    for path in task_files:
        documents = encode_documents(read_task_file(path, max_documents, flag), processor)
        if not documents:
            raise TaskFileError(f"{flag} {path}: holds no documents")
        longest = max(range(len(documents)), key=lambda i: documents[i].input_length)
        needed = documents[longest].input_length
        if needed > max_seq_len:
            raise TaskFileError(f"{flag} {path}: document {longest + 1} needs {needed} tokens "
                                f"of context before its last answer, more than the model's "
                                f"max_seq_len = {max_seq_len}; make shorter documents (lower "
                                "--hops, --chains or --length) or evaluate a model with a "
                                "longer context")
        encoded.extend(documents)
    return encoded


def score_encoded(model: DecoderLM, documents: Sequence[EncodedDocument], *, pad_id: int,
                  batch_size: int = 8,
                  device: torch.device | str = "cpu") -> dict[str, TaskScore]:
    """Exact-match scores of `model` (on `device`, in eval mode; its mode is restored after) on
    documents already encoded (`read_encoded`: checked before any model is loaded or trained),
    per task in order of first appearance; `pad_id` pads the batches."""
    was_training = model.training
    model.eval()
    try:
        return score_documents(documents, model_predictor(model, device),
                               batch_size=batch_size, pad_id=pad_id)
    finally:
        model.train(was_training)


def evaluate_tasks(model: DecoderLM, processor: Tokenizer,
                   task_files: Sequence[str | Path], *,
                   batch_size: int = 8, max_documents: int = 0,
                   device: torch.device | str = "cpu") -> list[TaskScore]:
    """Exact-match scores of `model` per task of `task_files`, documents of the same task name
    pooled across files, in order of first appearance. `processor` is the model's tokenizer."""
    documents = read_encoded(task_files, processor, model.config.max_seq_len, max_documents)
    return list(score_encoded(model, documents, pad_id=max(processor.pad_id, 0),
                              batch_size=batch_size, device=device).values())
