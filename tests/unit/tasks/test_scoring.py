"""Exact-match scoring (megabeta/tasks/scoring.py): a perfect oracle scores 100 %, a constant
predictor its chance level, an answer counts only with every token right, and batching changes
nothing."""

from __future__ import annotations

import math
from itertools import permutations

import numpy as np
import pytest
import torch
from support.tasks_helpers import SOLVED, VARIANTS

from data_tools.tokenizer import load_tokenizer
from megabeta.tasks.document import read_task_file
from megabeta.tasks.evaluate import encode_documents
from megabeta.tasks.scoring import EncodedDocument, answer_spans, score_documents


@pytest.fixture(scope="module")
def encoded(files, tokenizer) -> dict[str, list[EncodedDocument]]:
    processor = load_tokenizer(tokenizer)
    return {name: encode_documents(read_task_file(path), processor)
            for name, path in files.items()}


def oracle(documents: list[EncodedDocument]):
    """Predicts every next token right: looks each row (without its padding) up among the
    documents and returns the tokens that follow."""
    by_input = {tuple(d.tokens[:d.input_length].tolist()): d.tokens for d in documents}

    def predict(tokens: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(tokens)
        for row, ids in enumerate(tokens.tolist()):
            while ids and ids[-1] == 0:  # pad id 0 never occurs in encoded text
                ids.pop()
            out[row, :len(ids)] = torch.from_numpy(by_input[tuple(ids)][1:len(ids) + 1])
        return out

    return predict


def constant_answer(answer: list[int], marker: int):
    """Answers `answer` (token ids) after every `marker` token, whatever the document says; a
    one-token answer is the constant predictor itself."""
    fixed = torch.tensor(answer)

    def predict(tokens: torch.Tensor) -> torch.Tensor:
        if len(answer) == 1:
            return torch.full_like(tokens, answer[0])
        out = torch.zeros_like(tokens)
        for row, col in (tokens == marker).nonzero().tolist():
            span = min(len(answer), tokens.shape[1] - col)
            out[row, col:col + span] = fixed[:span]
        return out

    return predict


def within_chance(correct: int, answers: int, chance: float) -> bool:
    """|accuracy - chance| below 4 standard errors of a binomial proportion: a predictor at
    chance fails it with probability < 1e-4, and the seeds are fixed, so the test is not flaky;
    a generator whose answers leak (or are skewed) by more than that fails it."""
    return abs(correct / answers - chance) < 4 * math.sqrt(chance * (1 - chance) / answers)


@pytest.mark.parametrize("name", VARIANTS)
def test_oracle_scores_every_answer(encoded, name):
    documents = encoded[name]
    (score,) = score_documents(documents, oracle(documents), batch_size=7).values()
    assert score.documents == SOLVED and score.correct == score.answers
    assert score.answers == sum(len(answer_spans(d.mask)) for d in documents)
    assert score.accuracy == 1.0


@pytest.mark.parametrize("name", ["chains-n8", "chains-n3-k5-v4", "parity", "parity-L5"])
def test_constant_predictor_scores_chance(encoded, tokenizer, name):
    processor = load_tokenizer(tokenizer)
    documents = encoded[name]
    values = 4 if name == "chains-n3-k5-v4" else 2 if name.startswith("parity") else 10
    total = 0
    for value in range(values):
        (token,) = processor.encode(str(value))
        (score,) = score_documents(documents, constant_answer([token], -1)).values()
        assert score.chance == 1 / values
        assert within_chance(score.correct, score.answers, score.chance), (value, score)
        total += score.correct
    assert total == score.answers  # each answer is exactly one of the values


@pytest.mark.parametrize("name", ["S5", "A5"])
def test_constant_permutation_scores_chance(encoded, tokenizer, name):
    processor = load_tokenizer(tokenizer)
    (marker,) = processor.encode(">")
    documents = encoded[name][:50]  # 120 predictors: the sum check below needs every one
    total = 0
    for element in permutations("12345"):
        answer = processor.encode("".join(element))
        (score,) = score_documents(documents, constant_answer(answer, marker),
                                   batch_size=50).values()
        total += score.correct
        if element in {tuple("12345"), tuple("21345"), tuple("53412")}:
            odd = element == tuple("21345")
            chance = 0.0 if (odd and name == "A5") else score.chance
            assert score.chance == (1 / 60 if name == "A5" else 1 / 120)
            assert (score.correct == 0 if chance == 0.0
                    else within_chance(score.correct, score.answers, chance)), (element, score)
    assert total == score.answers  # each answer is exactly one element


def test_exact_match_needs_every_token_of_an_answer():
    tokens = np.array([5, 6, 7, 8, 9, 10, 11, 2], dtype=np.int32)
    mask = np.array([0, 1, 1, 0, 1, 0, 1, 0], dtype=np.uint8)
    assert answer_spans(mask) == [(1, 3), (4, 5), (6, 7)]
    document = EncodedDocument("t", tokens, mask, 0.5)
    assert document.input_length == 6

    def one_wrong(inputs: torch.Tensor) -> torch.Tensor:
        out = torch.from_numpy(tokens[1:inputs.shape[1] + 1].astype(np.int64))[None].clone()
        out[0, 1] = 0  # the second token of the first answer
        return out

    (score,) = score_documents([document], one_wrong).values()
    assert (score.answers, score.correct) == (3, 2)
    with pytest.raises(ValueError, match="scores its first token"):
        score_documents([EncodedDocument("t", tokens, np.roll(mask, -1))], one_wrong)
    with pytest.raises(ValueError, match="one task name must be one variant"):
        score_documents([document, EncodedDocument("t", tokens, mask, 0.1)], one_wrong)


def test_scores_do_not_depend_on_batching(encoded):
    documents = encoded["chains-n8"][:40] + encoded["parity-L5"][:40] + encoded["S5"][:40]

    def echo(tokens: torch.Tensor) -> torch.Tensor:  # causal: output t depends on token t only
        return (tokens * 7 + 3) % 320

    results = [{k: v.as_dict() for k, v in score_documents(documents, echo, batch_size=b).items()}
               for b in (1, 6, 120)]
    assert results[0] == results[1] == results[2] and len(results[0]) == 3
